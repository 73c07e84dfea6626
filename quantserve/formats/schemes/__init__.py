"""Quantized HF checkpoints: one typed config class per quantization method, parsed once by detect().

A scheme (GPTQ, AWQ, Marlin, compressed-tensors, FP8, MXFP4, INT8) is one module of this package holding one QuantScheme subclass,
listed in schemes() below: a new method is its file plus one line there. The class owns everything the rest of
quantserve asks about its method:

- `parse`: the quantization config into typed fields, refusing what quantserve cannot serve;
- `check`: the tensor table against those fields (fingerprints and shapes), before any data is read;
- `layout` and `layer`: which tensors form a linear, how they decode, and each layer's own settings;
- `cannot_hold`: what its layout can store, from which `repack_targets` lists what a checkpoint can be
  rewritten into.

detect() keeps the parsed scheme on ModelSpec.scheme (ModelSpec.quant is its `describe()`); readers, backends
and converters ask it, never the format name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import fields
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

from quantserve.formats.spec import SafetensorsTensor

if TYPE_CHECKING:
    from quantserve.formats.quant_tensors import LayerQuant, Layout

Tensors = Mapping[str, SafetensorsTensor]


class QuantScheme(ABC):
    """A parsed quantization config. Subclasses are frozen dataclasses with at least `bits` and `group_size`;
    fields declared with repr=False are internal (per-module rules) and left out of `describe()`."""

    name: ClassVar[str]  # detect()'s format name, and the writer's in converters.hf_quant
    quant_methods: ClassVar[tuple[str, ...]]  # quantization_config quant_method values this class parses
    label: ClassVar[str]  # how people write it: "GPTQ"
    writable: ClassVar[bool] = True  # `quantserve convert --format` writes it
    float_weights: ClassVar[bool] = False  # FP8, MXFP4: float codes that no integer layout holds
    bits: int
    group_size: int  # -1: one group over K

    @classmethod
    @abstractmethod
    def parse(cls, qc: dict[str, Any], where: str) -> QuantScheme:
        """The config as typed fields. Raises ModelFileError or UnsupportedFormatError naming `where`."""

    @abstractmethod
    def check(self, tensors: Tensors, where: str) -> None:
        """Raise ModelFileError if the tensors contradict the config (wrong layout, bits or group size)."""

    @abstractmethod
    def layout(self) -> Layout:
        """The tensors of one linear and their decoder. Raises UnsupportedFormatError for a layout this
        scheme detects but quantserve does not read."""

    @abstractmethod
    def layer(self, prefix: str) -> LayerQuant:
        """The settings of one linear, after the config's per-module rules."""

    @classmethod
    @abstractmethod
    def cannot_hold(cls, bits: int, group_size: int, act_order: bool) -> str | None:
        """Why this layout cannot store such weights, or None if it can."""

    def weights(self) -> tuple[int, int, bool]:
        """(bits, group_size, act order) as the config states them for every layer."""
        return self.bits, self.group_size, False

    def summary(self) -> str:
        """One phrase for `quantserve inspect`: "GPTQ 4-bit (group_size 128, gptq zeros)"."""
        bits, group, _ = self.weights()
        return f"{self.label} {bits}-bit (group_size {group})"

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.repr}  # type: ignore[arg-type]

    def repack_targets(self) -> tuple[str, ...]:
        """The schemes `quantserve convert --format` can rewrite this checkpoint into, losslessly (per-module
        overrides may still make one layer refuse; the writer then names it)."""
        return tuple(name for name, cls in schemes().items() if cls.cannot_hold(*self.weights()) is None)


@cache
def schemes() -> dict[str, type[QuantScheme]]:
    """Every scheme by format name, each module imported on the first call."""
    from quantserve.formats.schemes.awq import AWQ
    from quantserve.formats.schemes.compressed_tensors import CompressedTensors
    from quantserve.formats.schemes.fp8 import FP8, CompressedFP8
    from quantserve.formats.schemes.gptq import GPTQ
    from quantserve.formats.schemes.int8 import CompressedInt8
    from quantserve.formats.schemes.marlin import Marlin
    from quantserve.formats.schemes.mxfp4 import CompressedMXFP4, CompressedNVFP4

    listed = (
        AWQ,
        CompressedTensors,
        CompressedFP8,
        CompressedInt8,
        CompressedMXFP4,
        CompressedNVFP4,
        FP8,
        GPTQ,
        Marlin,
    )
    return {cls.name: cls for cls in listed}


def writable_schemes() -> list[str]:
    """The format names `quantserve convert --format` writes."""
    return sorted(name for name, cls in schemes().items() if cls.writable)


def scheme_for_method(method: str | None) -> type[QuantScheme] | None:
    return next((cls for cls in schemes().values() if method in cls.quant_methods), None)


def quant_methods() -> list[str]:
    return sorted(m for cls in schemes().values() for m in cls.quant_methods)
