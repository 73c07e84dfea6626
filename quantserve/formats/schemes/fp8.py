"""FP8 as the official releases lay it out (DeepSeek-V3, Qwen3, transformers' FineGrainedFP8Config): `weight` in
float8_e4m3fn with a float32 `weight_scale_inv` per 128×128 block, or one per tensor (docs/quantized-checkpoints.md,
"FP8")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import describe_layer, layers_marked

SCALE = "weight_scale_inv"


@dataclass(frozen=True)
class FP8(QuantScheme):
    name = "fp8"
    quant_methods = ("fp8",)
    label = "FP8"
    writable = False  # read and served; `convert --format` does not write it

    fmt: str  # e4m3, the only FP8 format of weights in the wild
    weight_block_size: tuple[int, int] | None  # None: one scale per tensor
    activation_scheme: (
        str  # dynamic or static: how the checkpoint's authors quantize activations (we keep them)
    )

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        fmt = str(qc.get("fmt") or "e4m3").lower()
        if fmt != "e4m3":
            raise UnsupportedFormatError(
                f"{where}: FP8 fmt '{fmt}' is not supported (weights are e4m3 in every FP8 release); "
                "re-export the weights as e4m3"
            )
        block = qc.get("weight_block_size")
        if block is not None and not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise ModelFileError(
                f"{where}: weight_block_size {block!r} must be two positive integers [rows, columns], e.g. "
                "[128, 128], or null for one scale per tensor"
            )
        act = str(qc.get("activation_scheme") or "dynamic").lower()
        if act not in ("dynamic", "static"):
            raise ModelFileError(f"{where}: activation_scheme '{act}' must be 'dynamic' or 'static'")
        return cls(fmt, None if block is None else (block[0], block[1]), act)

    @property
    def bits(self) -> int:  # type: ignore[override]
        return 8

    @property
    def group_size(self) -> int:  # type: ignore[override]
        return -1 if self.weight_block_size is None else self.weight_block_size[1]

    def check(self, tensors: Tensors, where: str) -> None:
        for prefix in layers_marked(tensors, SCALE, "fp8", where):
            w, s = tensors.get(prefix + ".weight"), tensors[f"{prefix}.{SCALE}"]
            if w is None or len(w.shape) != 2:
                raise ModelFileError(
                    f"{where}: {describe_layer(prefix, tensors)} has a {SCALE} but no 2-D weight; the checkpoint "
                    "is damaged or incomplete"
                )
            if w.dtype != "F8_E4M3":
                raise ModelFileError(
                    f"{where} says fmt {self.fmt} but {describe_layer(prefix, tensors)} stores {w.dtype} weights; "
                    "fix the quantization config or re-download the checkpoint"
                )
            if s.dtype not in ("F32", "BF16", "F16"):
                raise ModelFileError(
                    f"{where}: {describe_layer(prefix, tensors)}: {SCALE} must be F32, BF16 or F16"
                )
            n, k = w.shape
            bn, bk = self.weight_block_size or (n, k)
            grid = (-(-n // bn), -(-k // bk))
            got = tuple(s.shape) if len(s.shape) == 2 else None
            if (self.weight_block_size is None and s.n_elements != 1) or (
                self.weight_block_size is not None and got != grid
            ):
                raise ModelFileError(
                    f"{where} says weight_block_size {list(self.weight_block_size or ()) or 'null (one scale)'} "
                    f"but {describe_layer(prefix, tensors)} has {SCALE} {list(s.shape)}; [{n}, {k}] in blocks of "
                    f"[{bn}, {bk}] needs {list(grid)}. Fix the quantization config or re-download the checkpoint"
                )
            if self.activation_scheme == "static" and prefix + ".input_scale" not in tensors:
                raise ModelFileError(
                    f"{where} says activation_scheme static but {describe_layer(prefix, tensors)} has no "
                    "input_scale; the checkpoint is incomplete"
                )
        for name, t in tensors.items():
            if (
                t.dtype.startswith("F8")
                and len(t.shape) == 2
                and name.removesuffix(".weight") + f".{SCALE}" not in tensors
            ):
                raise ModelFileError(
                    f"{where}: tensor '{name}' is {t.dtype} but has no {SCALE} beside it; the checkpoint is "
                    "damaged or incomplete"
                )

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_fp8

        return Layout(SCALE, ("weight", SCALE, "input_scale"), decode_fp8)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        return LayerQuant(8, self.group_size, block=self.weight_block_size)

    def summary(self) -> str:
        scales = (
            "one scale per tensor"
            if self.weight_block_size is None
            else f"{self.weight_block_size[0]}×{self.weight_block_size[1]} block scales"
        )
        return f"FP8 {self.fmt} ({scales}, {self.activation_scheme} activations)"

    def repack_targets(self) -> tuple[str, ...]:
        return ()  # float weights: no integer layout holds them

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        return "FP8 checkpoints are read, not written: quantserve writes FP8 from no other format"
