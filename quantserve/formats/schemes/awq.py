"""AWQ (AutoAWQ): 4-bit, asymmetric, no act-order; the tensor layout depends on the `version` it was exported
for, and quantserve reads GEMM (and its aliases) and GEMV (docs/quantized-checkpoints.md, "AWQ")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantserve.errors import UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import expect, int_field, layers_marked, mismatch
from quantserve.kernels.grouping import n_groups

# AutoAWQ `version` -> the layout (fingerprint) its tensors have
VERSIONS = {
    "gemm": "awq-gemm", "exllama": "awq-gemm", "ipex": "awq-gemm", "gemv": "awq-gemv",
    "gemv_fast": "awq-gemv_fast", "marlin": "awq-marlin",
}  # fmt: skip


@dataclass(frozen=True)
class AWQ(QuantScheme):
    name = "awq"
    quant_methods = ("awq",)
    label = "AWQ"

    bits: int
    group_size: int
    zero_point: bool
    version: str

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        bits = int_field(qc, ("bits", "w_bit"), 4, where)
        group = int_field(qc, ("group_size", "q_group_size"), 128, where)
        version = str(qc.get("version") or "gemm").lower()
        if version not in VERSIONS:
            raise UnsupportedFormatError(
                f"{where}: AWQ version '{version}' is unknown (known: {', '.join(VERSIONS)})"
            )
        if bits != 4 or group == 0 or group < -1:
            raise UnsupportedFormatError(
                f"{where}: AWQ bits {bits} / group_size {group} unsupported (AWQ is 4-bit)"
            )
        return cls(bits, group, bool(qc.get("zero_point", True)), version)

    def check(self, tensors: Tensors, where: str) -> None:
        want = VERSIONS[self.version]
        for prefix in layers_marked(tensors, "qweight", "awq", where):
            expect(prefix, tensors, want, "awq", where)
            qw, sc = tensors[prefix + ".qweight"], tensors[prefix + ".scales"]
            if want == "awq-gemm" and sc.shape[0] != n_groups(qw.shape[0], self.group_size):
                implied = f"{sc.shape[0]} groups over K = {qw.shape[0]}"
                raise mismatch(where, "group_size", self.group_size, prefix, tensors, implied)

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_awq_gemm, decode_awq_gemv

        decode = {"awq-gemm": decode_awq_gemm, "awq-gemv": decode_awq_gemv}.get(VERSIONS[self.version])
        if decode is None:
            raise UnsupportedFormatError(
                f"AWQ version '{self.version}' (its int16/F16 or pre-permuted Marlin tensors) is not supported; "
                "re-export the model as AWQ 'gemm' (AutoAWQ's default) or as GPTQ"
            )
        return Layout("qweight", ("qweight", "qzeros", "scales"), decode)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        return LayerQuant(self.bits, self.group_size, sym=False)

    def summary(self) -> str:
        return f"AWQ {self.bits}-bit {self.version} (group_size {self.group_size})"

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        if bits != 4:
            return f"AWQ is 4-bit only, these weights are {bits}-bit"
        if act_order:
            return "AWQ cannot store act-order (a g_idx)"
        if group_size == -1:
            return "AWQ needs a positive group size"
        return None
