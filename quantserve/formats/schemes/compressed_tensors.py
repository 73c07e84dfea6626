"""compressed-tensors pack-quantized (llm-compressor's W4A16 and kin): int weights packed along K into int32,
one scheme per `config_groups` entry chosen by its targets (docs/quantized-checkpoints.md,
"compressed-tensors"). Its float-quantized FP8 is schemes/fp8.py's CompressedFP8, its MXFP4 schemes/mxfp4.py's, its
int-quantized INT8 schemes/int8.py's."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.schemes import QuantScheme, Tensors
from quantserve.formats.schemes.fingerprint import describe_layer, int_field, layers_marked, mismatch
from quantserve.kernels.grouping import SUPPORTED_BITS, n_groups

_ACTORDER = {None: None, False: None, True: "group", "group": "group", "dynamic": "group"}
_ACTORDER |= {"weight": "weight", "static": "weight"}


@dataclass(frozen=True)
class _Group:
    """One config_groups entry: the modules it targets and how their weights are quantized."""

    targets: tuple[str, ...]
    num_bits: int
    strategy: str
    group_size: int | None
    symmetric: bool

    def matches(self, prefix: str) -> bool:
        """compressed-tensors target matching: 're:' regexes, module names, or a class name ('Linear')."""
        for target in self.targets:
            if target.startswith("re:"):
                if re.match(target[3:], prefix):
                    return True
            elif target == "Linear" or target == prefix or prefix.endswith("." + target):
                return True
        return False


def _group(g: dict[str, Any], where: str) -> _Group:
    w = g["weights"]
    group = w.get("group_size")
    return _Group(
        tuple(str(t) for t in g.get("targets") or ["Linear"]),
        int_field(w, ("num_bits",), None, where),
        str(w.get("strategy") or "tensor"),
        int(group) if isinstance(group, int | float) and not isinstance(group, bool) else None,
        bool(w.get("symmetric", True)),
    )


def config_entries(qc: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The config_groups entries that carry `weights` arguments (every scheme of this format reads them)."""
    raw = qc.get("config_groups")
    entries = [g for g in raw.values() if isinstance(g, dict)] if isinstance(raw, dict) else []
    entries = [g for g in entries if isinstance(g.get("weights"), dict)]
    if not entries:
        raise ModelFileError(
            f"{where}: compressed-tensors config has no config_groups with 'weights' arguments"
        )
    return entries


@dataclass(frozen=True)
class CompressedTensors(QuantScheme):
    name = "compressed-tensors"
    quant_methods = ("compressed-tensors",)
    label = "CT"

    format: str
    num_bits: int
    group_size: int | None
    symmetric: bool
    strategy: str
    actorder: str | None
    packing: str = field(default="auto", repr=False)  # word (< 0.18), dense (>= 0.18), auto: by tensor width
    groups: tuple[_Group, ...] = field(default=(), repr=False)

    @classmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        entries = config_entries(qc, where)
        first = entries[0]
        w = first["weights"]
        fmt = str(first.get("format") or qc.get("format") or "")
        if fmt == "float-quantized":  # FP8 weights: llm-compressor's FP8, FP8_DYNAMIC, FP8_BLOCK
            from quantserve.formats.schemes.fp8 import CompressedFP8

            return CompressedFP8.from_groups(entries, where)
        if fmt == "int-quantized":  # llm-compressor's W8A8 (SmoothQuant, GPTQ): int8 weights, one per byte
            from quantserve.formats.schemes.int8 import CompressedInt8

            return CompressedInt8.from_groups(entries, where)
        if fmt == "mxfp4-pack-quantized":  # llm-compressor's MXFP4A16
            from quantserve.formats.schemes.mxfp4 import CompressedMXFP4

            return CompressedMXFP4.from_groups(entries, where)
        if fmt == "nvfp4-pack-quantized":  # llm-compressor's NVFP4A16 and NVFP4
            from quantserve.formats.schemes.mxfp4 import CompressedNVFP4

            return CompressedNVFP4.from_groups(entries, where)
        if fmt != "pack-quantized" or w.get("type", "int") != "int":
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors format '{fmt}' with {w.get('type', 'int')} weights is not supported "
                "(only pack-quantized int weights, e.g. W4A16); re-export with llm-compressor's W4A16 scheme"
            )
        groups = tuple(_group(g, where) for g in entries)
        bits = groups[0].num_bits
        if not 1 <= bits <= 8:
            raise UnsupportedFormatError(
                f"{where}: compressed-tensors num_bits {bits} unsupported (int weights are 1-8 bit)"
            )
        actorder = w.get("actorder")
        if isinstance(actorder, str | bool | None):
            actorder = _ACTORDER.get(actorder.lower() if isinstance(actorder, str) else actorder, actorder)
        m = re.match(r"(\d+)\.(\d+)", str(qc.get("version") or ""))
        # a dense bitstream from compressed-tensors 0.18.0; without a version the tensor width decides
        packing = "auto" if m is None else ("dense" if (int(m[1]), int(m[2])) >= (0, 18) else "word")
        g0 = groups[0]
        return cls(
            fmt,
            bits,
            w.get("group_size"),
            g0.symmetric,
            g0.strategy,
            None if actorder is None else str(actorder),
            packing,
            groups,
        )

    @property
    def bits(self) -> int:  # type: ignore[override]
        return self.num_bits

    def weights(self) -> tuple[int, int, bool]:
        group = self.group_size if self.strategy == "group" and isinstance(self.group_size, int) else -1
        return self.num_bits, group, self.actorder is not None

    def check(self, tensors: Tensors, where: str) -> None:
        bits, group = self.num_bits, self.group_size
        for prefix in layers_marked(tensors, "weight_packed", "compressed-tensors", where):
            packed, scale = tensors[prefix + ".weight_packed"], tensors.get(prefix + ".weight_scale")
            if packed.dtype != "I32" or len(packed.shape) != 2 or scale is None or len(scale.shape) != 2:
                raise ModelFileError(
                    f"{where}: {describe_layer(prefix, tensors)} needs I32 2-D weight_packed and weight_scale"
                )
            if scale.shape[0] != packed.shape[0]:
                raise mismatch(
                    where,
                    "format",
                    self.format,
                    prefix,
                    tensors,
                    "weight_scale rows != weight_packed rows (N)",
                )
            if not self.symmetric and prefix + ".weight_zero_point" not in tensors:
                raise mismatch(
                    where, "symmetric", False, prefix, tensors, "a symmetric layer (no weight_zero_point)"
                )
            if len(self.groups) == 1 and self.strategy == "group" and isinstance(group, int) and group > 0:
                # K lies in the range the packed width allows, under either packing rule (whole values per word
                # before compressed-tensors 0.18, a dense bitstream after; the same for 1/2/4/8 bits).
                cols, pf = packed.shape[1], 32 // bits
                k_max = max(cols * 32 // bits, cols * pf)
                k_min = min((cols - 1) * 32 // bits + 1, (cols - 1) * pf + 1)
                lo, hi = n_groups(max(k_min, 1), group), n_groups(k_max, group)
                if not lo <= scale.shape[1] <= hi:
                    raise mismatch(
                        where, "num_bits/group_size", f"{bits}/{group}", prefix, tensors, f"K ≈ {k_max}"
                    )

    def layout(self):
        from quantserve.formats.quant_tensors import Layout, decode_compressed_tensors

        for g in self.groups:
            if g.strategy not in ("group", "channel"):
                raise UnsupportedFormatError(
                    f"compressed-tensors weight strategy '{g.strategy}' is not supported (group or channel); "
                    "re-export with llm-compressor's W4A16 scheme"
                )
        suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
        return Layout("weight_packed", suffixes, decode_compressed_tensors)

    def layer(self, prefix: str):
        from quantserve.formats.quant_tensors import LayerQuant

        g = next((g for g in self.groups if g.matches(prefix)), self.groups[0])
        group = g.group_size if g.strategy == "group" and g.group_size else -1
        return LayerQuant(g.num_bits, group, g.symmetric, packing=self.packing)

    def summary(self) -> str:
        return f"compressed-tensors {self.format} {self.num_bits}-bit ({self.strategy} strategy)"

    @classmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        return (
            None
            if bits in SUPPORTED_BITS
            else f"quantserve writes {SUPPORTED_BITS}-bit weights, not {bits}-bit"
        )
