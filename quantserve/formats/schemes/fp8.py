"""FP8 (e4m3) weights with scales per tensor, per output channel or per block, in the two layouts that ship:

- `FP8`: as the official releases lay it out (DeepSeek-V3, Qwen3, transformers' FineGrainedFP8Config):
  `quant_method: fp8`, a float32 `weight_scale_inv` per 128×128 block, or one per tensor;
- `CompressedFP8`: compressed-tensors `float-quantized` (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK presets),
  a `weight_scale` per tensor, per channel or per block; reached through CompressedTensors.parse.

docs/quantized-checkpoints.md, "FP8".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import describe_layer, layers_marked


@dataclass(frozen=True)
class FP8(QuantScheme):
    name = "fp8"
    quant_methods = ("fp8",)
    label = "FP8"
    writable = False  # read and served; `convert --format` does not write it
    float_weights = True
    scale: ClassVar[str] = "weight_scale_inv"  # the tensor beside each FP8 weight, which multiplies it

    fmt: str  # e4m3, the only FP8 format of weights in the wild
    weight_block_size: tuple[int, int] | None  # with strategy "block"
    activation_scheme: (
        str  # dynamic or static: how the checkpoint's authors quantize activations (we keep them)
    )

    @property
    def strategy(self) -> str:
        """tensor, channel or block: what one scale covers."""
        return "tensor" if self.weight_block_size is None else "block"

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        fmt = str(qc.get("fmt") or "e4m3").lower()
        if fmt != "e4m3":
            raise UnsupportedFormatError(
                f"{where}: FP8 fmt '{fmt}' is not supported (weights are e4m3 in every FP8 release); "
                "re-export the weights as e4m3"
            )
        block = _block(qc.get("weight_block_size"), "weight_block_size", where)
        act = str(qc.get("activation_scheme") or "dynamic").lower()
        if act not in ("dynamic", "static"):
            raise ModelFileError(f"{where}: activation_scheme '{act}' must be 'dynamic' or 'static'")
        return cls(fmt, block, act)

    @property
    def bits(self) -> int:  # type: ignore[override]
        return 8

    @property
    def group_size(self) -> int:  # type: ignore[override]
        return -1 if self.weight_block_size is None else self.weight_block_size[1]

    def grid(self, n: int, k: int) -> tuple[int, int]:
        """The shape of the scales of an [n, k] weight."""
        if self.strategy == "channel":
            return n, 1
        bn, bk = self.weight_block_size or (n, k)
        return -(-n // bn), -(-k // bk)

    def check(self, tensors: Tensors, where: str) -> None:
        scale = self.scale
        method = self.quant_methods[0] if self.quant_methods else "compressed-tensors"
        for prefix in layers_marked(tensors, scale, method, where):
            w, s = tensors.get(prefix + ".weight"), tensors[f"{prefix}.{scale}"]
            if w is None or len(w.shape) != 2:
                raise ModelFileError(
                    f"{where}: {describe_layer(prefix, tensors)} has a {scale} but no 2-D weight; the checkpoint "
                    "is damaged or incomplete"
                )
            if w.dtype != "F8_E4M3":
                raise ModelFileError(
                    f"{where} says {self.fmt} FP8 but {describe_layer(prefix, tensors)} stores {w.dtype} weights; "
                    "fix the quantization config or re-download the checkpoint"
                )
            if s.dtype not in ("F32", "BF16", "F16"):
                raise ModelFileError(
                    f"{where}: {describe_layer(prefix, tensors)}: {scale} must be F32, BF16 or F16"
                )
            n, k = w.shape
            want = self.grid(n, k)
            if (len(s.shape) == 2 and tuple(s.shape) != want) or s.n_elements != want[0] * want[1]:
                raise ModelFileError(
                    f"{where} says {self._granularity()} but {describe_layer(prefix, tensors)} has {scale} "
                    f"{list(s.shape)}; [{n}, {k}] needs {list(want)}. Fix the quantization config or re-download "
                    "the checkpoint"
                )
            if self.activation_scheme == "static" and prefix + ".input_scale" not in tensors:
                raise ModelFileError(
                    f"{where} says static activations but {describe_layer(prefix, tensors)} has no input_scale; "
                    "the checkpoint is incomplete"
                )
        for name, t in tensors.items():
            if (
                t.dtype.startswith("F8")
                and len(t.shape) == 2
                and name.removesuffix(".weight") + f".{scale}" not in tensors
            ):
                raise ModelFileError(
                    f"{where}: tensor '{name}' is {t.dtype} but has no {scale} beside it; the checkpoint is damaged "
                    "or incomplete"
                )

    def _granularity(self) -> str:
        if self.strategy == "block":
            return f"weight_block_size {list(self.weight_block_size or ())}"
        return "one scale per tensor" if self.strategy == "tensor" else "one scale per output channel"

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_fp8

        suffixes = ("weight", self.scale, "weight_zero_point", "input_scale", "input_zero_point")
        return Layout(self.scale, suffixes, decode_fp8)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        return LayerQuant(8, self.group_size, block=self.weight_block_size)

    def summary(self) -> str:
        if self.strategy == "block":
            assert self.weight_block_size is not None
            scales = f"{self.weight_block_size[0]}×{self.weight_block_size[1]} block scales"
        else:
            scales = f"one scale per {'tensor' if self.strategy == 'tensor' else 'output channel'}"
        return f"{self.label} {self.fmt} ({scales}, {self.activation_scheme} activations)"

    def repack_targets(self) -> tuple[str, ...]:
        return ()  # float weights: no integer layout holds them

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        return "FP8 checkpoints are read, not written: quantserve writes FP8 from no other format"


@dataclass(frozen=True)
class CompressedFP8(FP8):
    name = "compressed-tensors-fp8"
    quant_methods = ()  # quant_method compressed-tensors: CompressedTensors.parse hands float-quantized here
    label = "compressed-tensors FP8"
    scale: ClassVar[str] = "weight_scale"

    granularity: str = "tensor"  # tensor, channel or block (compressed-tensors' weight strategy)

    @property
    def strategy(self) -> str:
        return self.granularity

    @classmethod
    def from_groups(cls, entries: list[dict[str, Any]], where: str) -> CompressedFP8:
        """The config_groups of a `float-quantized` checkpoint; every group must quantize alike."""
        w = entries[0]["weights"]
        if any(e["weights"] != w for e in entries[1:]):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors FP8 groups with different weight arguments are not supported; "
                "quantize every linear with one scheme"
            )
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors float-quantized weights of {w.get('num_bits')} bits "
                f"({w.get('type')}) are not supported (FP8 is 8-bit float)"
            )
        if not w.get("symmetric", True):
            raise UnsupportedFormatError(
                f"{where}: asymmetric compressed-tensors FP8 (a weight_zero_point) is not supported; FP8 weights are "
                "symmetric in every llm-compressor preset"
            )
        strategy = str(w.get("strategy") or "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors FP8 weight strategy '{strategy}' is not supported (tensor, channel or "
                "block: llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK)"
            )
        block = _block(w.get("block_structure"), "block_structure", where) if strategy == "block" else None
        if strategy == "block" and block is None:
            raise ModelFileError(f"{where}: compressed-tensors FP8 strategy 'block' needs a block_structure")
        act = entries[0].get("input_activations")
        activations = "static" if isinstance(act, dict) and not act.get("dynamic", True) else "dynamic"
        return cls("e4m3", block, activations, strategy)


def _block(block: Any, key: str, where: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ModelFileError(
            f"{where}: {key} {block!r} must be two positive integers [rows, columns], e.g. [128, 128], or null "
            "for one scale per tensor"
        )
    return block[0], block[1]
