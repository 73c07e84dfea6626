"""INT8 weights as compressed-tensors' `int-quantized` format stores them (llm-compressor's W8A8: SmoothQuant or GPTQ
weights, with int8 activations quantized per token at run time): `weight` int8 [N, K] and `weight_scale` [N, 1] per
output channel ([1] per tensor, [N, K/G] per group). The integers are what QuantizedWeight holds (8-bit, symmetric:
the stored value plus 128), so the torch backend runs them on its W8A16 kernels, activations unquantized, and they
repack losslessly into GPTQ, Marlin or pack-quantized 8-bit (docs/quantized-checkpoints.md, "INT8 in
compressed-tensors")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import describe_layer, layers_marked


@dataclass(frozen=True)
class CompressedInt8(QuantScheme):
    name = "compressed-tensors-int8"
    quant_methods = ()  # quant_method compressed-tensors: CompressedTensors.parse hands int-quantized here
    label = "compressed-tensors INT8"
    writable = False  # read, served and repacked; no writer makes this layout

    strategy: str  # channel, tensor or group
    group_size: int  # -1 but for the group strategy
    activations: str  # "int8 per token (dynamic)", "int8 per tensor (static)" or "none"

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        from quantserve.formats.schemes.compressed_tensors import config_entries

        return cls.from_groups(config_entries(qc, where), where)

    @classmethod
    def from_groups(cls, entries: list[dict[str, Any]], where: str) -> CompressedInt8:
        w = entries[0]["weights"]
        if any(e["weights"] != w for e in entries[1:]):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors INT8 groups with different weight arguments are not supported; "
                "quantize every linear with one scheme"
            )
        strategy = str(w.get("strategy") or "tensor")
        if w.get("num_bits") != 8 or w.get("type", "int") != "int" or not w.get("symmetric", True):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors int-quantized weights must be symmetric 8-bit int (got num_bits "
                f"{w.get('num_bits')}, type {w.get('type')}, symmetric {w.get('symmetric')})"
            )
        if strategy not in ("channel", "tensor", "group"):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors INT8 weight strategy '{strategy}' is not supported (channel, tensor or "
                "group)"
            )
        if w.get("actorder"):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors int-quantized with actorder {w['actorder']!r} (a weight_g_idx) is not "
                "supported; re-export without act-order, or as pack-quantized (W8A16)"
            )
        group = int(w.get("group_size") or -1) if strategy == "group" else -1
        if strategy == "group" and group <= 0:
            raise ModelFileError(
                f"{where}: compressed-tensors INT8 strategy 'group' needs a positive group_size"
            )
        act = entries[0].get("input_activations")
        if isinstance(act, dict):
            per = str(act.get("strategy") or "tensor")
            activations = (
                f"int{act.get('num_bits', 8)} per {per} ({'dynamic' if act.get('dynamic') else 'static'})"
            )
        else:
            activations = "none"
        return cls(strategy, group, activations)

    @property
    def bits(self) -> int:  # type: ignore[override]
        return 8

    def check(self, tensors: Tensors, where: str) -> None:
        for prefix in layers_marked(tensors, "weight_scale", "compressed-tensors", where):
            w, s = tensors.get(prefix + ".weight"), tensors[prefix + ".weight_scale"]
            if w is None or w.dtype != "I8" or len(w.shape) != 2:
                raise ModelFileError(
                    f"{where} says int-quantized 8-bit but {describe_layer(prefix, tensors)} has no I8 2-D weight; "
                    "fix the quantization config or re-download the checkpoint"
                )
            n, k = w.shape
            want = {
                "channel": (n, 1),
                "tensor": (1,),
                "group": (n, k // self.group_size if self.group_size > 0 else 0),
            }
            shape = tuple(s.shape)
            if shape != want[self.strategy] and not (self.strategy == "tensor" and s.n_elements == 1):
                raise ModelFileError(
                    f"{where} says strategy {self.strategy} but {describe_layer(prefix, tensors)} has weight_scale "
                    f"{list(shape)}; [{n}, {k}] needs {list(want[self.strategy])}. Fix the quantization config or "
                    "re-download the checkpoint"
                )

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_int8

        suffixes = ("weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
        return Layout("weight_scale", suffixes, decode_int8)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        return LayerQuant(8, self.group_size)

    def weights(self) -> tuple[int, int, bool]:
        return 8, self.group_size, False

    def summary(self) -> str:
        scales = f"group_size {self.group_size}" if self.strategy == "group" else f"per {self.strategy}"
        return f"{self.label} (symmetric, {scales}; activations in the checkpoint: {self.activations})"

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        return (
            "quantserve writes no int-quantized layout; repack to gptq, marlin or compressed-tensors instead"
        )
