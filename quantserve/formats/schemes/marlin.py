"""Marlin (AutoGPTQ/candle-vllm `B`/`s`, vLLM's gptq_marlin layout): weights pre-tiled for the Marlin kernel,
4- or 8-bit (docs/quantized-checkpoints.md, "Marlin")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantserve.errors import UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import expect, int_field, layers_marked, mismatch
from quantserve.kernels.grouping import n_groups

MARLIN_BITS = (4, 8)
MARLIN_GROUPS = (-1, 32, 64, 128)  # vLLM's marlin_utils GPTQ_MARLIN_SUPPORTED_GROUP_SIZES


@dataclass(frozen=True)
class Marlin(QuantScheme):
    name = "marlin"
    quant_methods = ("marlin",)
    label = "Marlin"

    bits: int
    group_size: int

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        bits = int_field(qc, ("bits", "w_bit"), 4, where)
        group = int_field(qc, ("group_size", "q_group_size"), 128, where)
        # IST-DASLab/AutoGPTQ Marlin is 4-bit, groups 128/-1; vLLM's layout (which quantserve writes) adds 8-bit
        # and groups 32/64.
        if (why := cls.cannot_hold(bits, group, False)) is not None:
            raise UnsupportedFormatError(f"{where}: {why}")
        return cls(bits, group)

    def check(self, tensors: Tensors, where: str) -> None:
        for prefix in layers_marked(tensors, "B", "marlin", where):
            expect(prefix, tensors, "marlin", "marlin", where)
            b, s = tensors[prefix + ".B"], tensors[prefix + ".s"]
            if b.shape[1] * 2 != s.shape[1] * self.bits:
                raise mismatch(
                    where, "bits", self.bits, prefix, tensors, f"{2 * b.shape[1] // s.shape[1]}-bit"
                )
            if s.shape[0] != n_groups(16 * b.shape[0], self.group_size):
                implied = f"{s.shape[0]} groups over K = {16 * b.shape[0]}"
                raise mismatch(where, "group_size", self.group_size, prefix, tensors, implied)

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_marlin

        return Layout("B", ("B", "s", "g_idx", "perm", "zp", "workspace"), decode_marlin)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        return LayerQuant(self.bits, self.group_size)  # bits are re-derived from B's width per layer

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        if bits not in MARLIN_BITS or group_size not in MARLIN_GROUPS:
            return (
                f"Marlin checkpoints are {' or '.join(map(str, MARLIN_BITS))}-bit with group_size "
                f"{', '.join(map(str, MARLIN_GROUPS))}, got bits {bits} group_size {group_size}"
            )
        return None
