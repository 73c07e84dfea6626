"""The FP4 formats of compressed-tensors (docs/quantized-checkpoints.md, "MXFP4 and NVFP4 in compressed-tensors"):

- MXFP4, as it writes llm-compressor's MXFP4A16 (`mxfp4-pack-quantized`): e2m1 codes two to a byte in
  `weight_packed` [N, K/2], an e8m0 power-of-two scale per 32 in `weight_scale` [N, K/32], both uint8; the bytes of
  gpt-oss's MXFP4 experts, one linear at a time;
- NVFP4 (`nvfp4-pack-quantized`): the same codes, an e4m3 scale per 16 and a global scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import describe_layer, layers_marked

GROUP = 32
NV_GROUP = 16


@dataclass(frozen=True)
class CompressedMXFP4(QuantScheme):
    name = "compressed-tensors-mxfp4"
    quant_methods = ()  # quant_method compressed-tensors: CompressedTensors.parse hands mxfp4-pack-quantized here
    label = "compressed-tensors MXFP4"
    writable = False
    float_weights = True

    format: str = "mxfp4-pack-quantized"

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        from quantserve.formats.schemes.compressed_tensors import config_entries

        return cls.from_groups(config_entries(qc, where), where)

    @classmethod
    def from_groups(cls, entries: list[dict[str, Any]], where: str) -> CompressedMXFP4:
        w = entries[0]["weights"]
        if any(e["weights"] != w for e in entries[1:]):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors MXFP4 groups with different weight arguments are not supported; "
                "quantize every linear with one scheme"
            )
        if w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != GROUP:
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors mxfp4-pack-quantized weights must be 4-bit float in groups of {GROUP} "
                f"(got num_bits {w.get('num_bits')}, type {w.get('type')}, group_size {w.get('group_size')})"
            )
        act = entries[0].get("input_activations")
        if isinstance(act, dict):
            raise UnsupportedFormatError(
                f"{where}: MXFP4 with quantized activations (llm-compressor's MXFP4) is not supported; the weight-only "
                "MXFP4A16 is"
            )
        return cls()

    @property
    def bits(self) -> int:  # type: ignore[override]
        return 4

    @property
    def group_size(self) -> int:  # type: ignore[override]
        return GROUP

    def check(self, tensors: Tensors, where: str) -> None:
        for prefix in layers_marked(tensors, "weight_packed", "compressed-tensors", where):
            packed, scale = tensors[prefix + ".weight_packed"], tensors.get(prefix + ".weight_scale")
            ok = (
                packed.dtype == "U8"
                and len(packed.shape) == 2
                and scale is not None
                and scale.dtype == "U8"
                and len(scale.shape) == 2
                and (2 * packed.shape[1]) % GROUP == 0
                and tuple(scale.shape) == (packed.shape[0], 2 * packed.shape[1] // GROUP)
            )
            if not ok:
                raise ModelFileError(
                    f"{where}: {describe_layer(prefix, tensors)} is not MXFP4: weight_packed is uint8 [N, K/2] and "
                    f"weight_scale uint8 [N, K/{GROUP}], K a multiple of {GROUP}; the checkpoint is damaged"
                )

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_mxfp4

        return Layout("weight_packed", ("weight_packed", "weight_scale", "weight_zero_point"), decode_mxfp4)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        return LayerQuant(4, GROUP)

    def summary(self) -> str:
        return f"{self.label} (e2m1 weights, a power-of-two scale per {GROUP}, weight-only)"

    def repack_targets(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        return "MXFP4 checkpoints are read, not written: quantserve writes MXFP4 from no other format"


@dataclass(frozen=True)
class CompressedNVFP4(QuantScheme):
    """NVFP4 as compressed-tensors writes llm-compressor's NVFP4A16 and NVFP4 (`nvfp4-pack-quantized`): e2m1 codes
    two to a byte in `weight_packed` [N, K/2], an e4m3 scale per 16 in `weight_scale` [N, K/16] and a float32
    `weight_global_scale` [1] that divides them (kernels/nvfp4.py)."""

    name = "compressed-tensors-nvfp4"
    quant_methods = ()  # quant_method compressed-tensors: CompressedTensors.parse hands nvfp4-pack-quantized here
    label = "compressed-tensors NVFP4"
    writable = False
    float_weights = True

    activations: str = (
        "none"  # what the checkpoint does to activations (FP4 per 16 in NVFP4); quantserve keeps them
    )

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        from quantserve.formats.schemes.compressed_tensors import config_entries

        return cls.from_groups(config_entries(qc, where), where)

    @classmethod
    def from_groups(cls, entries: list[dict[str, Any]], where: str) -> CompressedNVFP4:
        w = entries[0]["weights"]
        if any(e["weights"] != w for e in entries[1:]):
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors NVFP4 groups with different weight arguments are not supported; "
                "quantize every linear with one scheme"
            )
        if w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != NV_GROUP:
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors nvfp4-pack-quantized weights must be 4-bit float in groups of "
                f"{NV_GROUP} (got num_bits {w.get('num_bits')}, type {w.get('type')}, group_size {w.get('group_size')})"
            )
        act = entries[0].get("input_activations")
        return cls("fp4 per 16 (dynamic)" if isinstance(act, dict) else "none")

    @property
    def bits(self) -> int:  # type: ignore[override]
        return 4

    @property
    def group_size(self) -> int:  # type: ignore[override]
        return NV_GROUP

    def check(self, tensors: Tensors, where: str) -> None:
        for prefix in layers_marked(tensors, "weight_packed", "compressed-tensors", where):
            packed = tensors[prefix + ".weight_packed"]
            scale, glob = tensors.get(prefix + ".weight_scale"), tensors.get(prefix + ".weight_global_scale")
            ok = (
                packed.dtype == "U8"
                and len(packed.shape) == 2
                and scale is not None
                and scale.dtype == "F8_E4M3"
                and (2 * packed.shape[1]) % NV_GROUP == 0
                and tuple(scale.shape) == (packed.shape[0], 2 * packed.shape[1] // NV_GROUP)
                and glob is not None
                and glob.n_elements == 1
            )
            if not ok:
                raise ModelFileError(
                    f"{where}: {describe_layer(prefix, tensors)} is not NVFP4: weight_packed is uint8 [N, K/2], "
                    f"weight_scale float8_e4m3fn [N, K/{NV_GROUP}] and weight_global_scale one float; the checkpoint "
                    "is damaged"
                )

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_nvfp4

        suffixes = (
            "weight_packed",
            "weight_scale",
            "weight_global_scale",
            "weight_zero_point",
            "input_global_scale",
        )
        return Layout("weight_packed", suffixes, decode_nvfp4)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        return LayerQuant(4, NV_GROUP)

    def summary(self) -> str:
        return (
            f"{self.label} (e2m1 weights, an e4m3 scale per {NV_GROUP} and a global one; activations in the "
            f"checkpoint: {self.activations})"
        )

    def repack_targets(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        return "NVFP4 checkpoints are read, not written: quantserve writes NVFP4 from no other format"
