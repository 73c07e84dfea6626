"""GPTQ (AutoGPTQ, GPTQModel): int32 words packed along K, zeros stored minus one (v1) or raw (v2), optional
act-order g_idx, GPTQModel's per-module `dynamic` rules (docs/quantized-checkpoints.md, "GPTQ")."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import expect, int_field, layers_marked, mismatch
from quantserve.formats.schemes.marlin import Marlin
from quantserve.kernels.grouping import SUPPORTED_BITS, n_groups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTQ(QuantScheme):
    name = "gptq"
    quant_methods = ("gptq",)
    label = "GPTQ"

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str  # gptq (v1 zeros) or gptq_v2
    zero_format: str = field(default="v1", repr=False)  # v1, v2, or auto: not stated, decided by the zeros
    dynamic: dict[str, Any] = field(default_factory=dict, repr=False)  # GPTQModel: regex -> overrides

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        stated = qc.get("checkpoint_format") or qc.get("format")
        ckpt = str(stated or "gptq").lower()
        if ckpt == "marlin" or qc.get("is_marlin_format"):
            return Marlin.parse(qc, where)
        if ckpt not in ("gptq", "gptq_v2"):
            raise UnsupportedFormatError(
                f"{where}: GPTQ checkpoint_format '{ckpt}' is not supported (only gptq and gptq_v2); "
                "export the model with GPTQModel format='gptq'"
            )
        if str(qc.get("pack_dtype", "int32")).lower() != "int32":
            raise UnsupportedFormatError(
                f"{where}: GPTQ pack_dtype {qc['pack_dtype']!r} is not supported (only int32)"
            )
        bits = int_field(qc, ("bits", "w_bit"), None, where)
        group = int_field(qc, ("group_size", "q_group_size"), -1, where)
        if bits not in SUPPORTED_BITS or group == 0 or group < -1:
            raise UnsupportedFormatError(
                f"{where}: GPTQ bits {bits} / group_size {group} unsupported (bits 2/3/4/8)"
            )
        dynamic = qc.get("dynamic") or {}
        if not isinstance(dynamic, dict):
            raise ModelFileError(
                f"{where}: GPTQ 'dynamic' must be an object of regex -> overrides, got {dynamic!r}"
            )
        sym = not qc["zero_point"] if "zero_point" in qc and "sym" not in qc else bool(qc.get("sym", True))
        zero_format = "v2" if ckpt == "gptq_v2" else ("v1" if stated else "auto")
        return cls(bits, group, sym, bool(qc.get("desc_act", False)), ckpt, zero_format, dynamic)

    def check(self, tensors: Tensors, where: str) -> None:
        for prefix in layers_marked(tensors, "qweight", "gptq", where):
            expect(prefix, tensors, "gptq", "gptq", where)
            qw, sc, gi = (
                tensors[prefix + ".qweight"],
                tensors[prefix + ".scales"],
                tensors.get(prefix + ".g_idx"),
            )
            if gi is None or self.dynamic or len(gi.shape) != 1 or gi.shape[0] == 0:
                continue  # per-module overrides: the layout is checked, the numbers come from the shapes
            k = gi.shape[0]
            if qw.shape[0] * 32 != k * self.bits:
                raise mismatch(
                    where, "bits", self.bits, prefix, tensors, f"{qw.shape[0] * 32 / k:g} bits (K = {k})"
                )
            if sc.shape[0] != n_groups(k, self.group_size):
                raise mismatch(
                    where,
                    "group_size",
                    self.group_size,
                    prefix,
                    tensors,
                    f"{sc.shape[0]} groups over K = {k}",
                )

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_gptq

        return Layout("qweight", ("qweight", "qzeros", "scales", "g_idx"), decode_gptq)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        base = LayerQuant(
            self.bits, self.group_size, self.sym, self.zero_format, from_shapes=bool(self.dynamic)
        )
        # GPTQModel dynamic_get: the first matching rule wins; "-:" skips the module (left dense), "+:" or no
        # prefix overrides bits/group_size/sym (ModelCloud/GPTQModel:gptqmodel/quantization/config.py)
        for pattern, over in self.dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], prefix):
                    log.warning(
                        "%s has qweight although dynamic rule %r skips it; trusting the tensors",
                        prefix,
                        pattern,
                    )
                    return base
            elif re.match(pattern.removeprefix("+:"), prefix):
                over = over if isinstance(over, dict) else {}
                return replace(
                    base,
                    bits=int(over.get("bits", base.bits)),
                    group_size=int(over.get("group_size", base.group_size)),
                    sym=bool(over.get("sym", base.sym)),
                )
        return base

    def weights(self) -> tuple[int, int, bool]:
        return self.bits, self.group_size, self.desc_act

    def summary(self) -> str:
        return f"GPTQ {self.bits}-bit (group_size {self.group_size}, {self.checkpoint_format} zeros)"

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        return None if bits in SUPPORTED_BITS else f"GPTQ stores {SUPPORTED_BITS}-bit weights, not {bits}-bit"
