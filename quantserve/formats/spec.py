"""Frozen data types produced by the format readers: GGUF and safetensors tables, and the detected ModelSpec."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantserve.errors import ModelFileError

if TYPE_CHECKING:
    from quantserve.formats.schemes import QuantScheme


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF tensor table, already validated against the file size."""

    name: str
    shape: tuple[int, ...]  # ne order: shape[0] is the contiguous dimension (K of an HF [N, K] weight)
    ggml_type: int
    type_name: str  # "Q4_1", "F32", ...
    offset: int  # absolute byte offset of the first data byte in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class GGUFInfo:
    """Header, metadata and tensor table of one validated GGUF file (one part of a split model)."""

    path: Path
    version: int
    file_size: int
    alignment: int
    data_offset: int  # absolute offset of the tensor data section
    metadata: dict[str, Any]  # scalars as int/float/bool/str, arrays as (nested) lists
    tensors: tuple[GGUFTensorInfo, ...]
    file_type: str  # "Q4_1", "Q4_K_M", ...: general.file_type, or the commonest 2-D tensor type

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelFileError(
                f"{self.path.name}: no string 'general.architecture' key (found {arch!r}); "
                "a non-first part of a split GGUF has none — pass the first part (…-00001-of-…)"
            )
        return arch

    @property
    def context_length(self) -> int | None:
        arch = self.metadata.get("general.architecture")
        value = self.metadata.get(f"{arch}.context_length") if isinstance(arch, str) else None
        # bool is an int subclass; a bool context length is a corrupt file, not a length of 1
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) and value else None

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def rank_outputs(self) -> int:
        """Outputs of a classification head that llama.cpp's rank pooling applies, as convert_hf_to_gguf.py writes
        one: cls.output (after an optional cls dense layer: bge-reranker), or a cls layer of one or two outputs alone
        (jina-reranker-v1-tiny). As many as the classifier's labels where it names them (Qwen3-Reranker: yes, no).
        0 for a model without one; a cls layer as wide as the model is a dense layer before pooling (ModernBERT
        embedders), not a classifier."""
        heads = {t.name: t for t in self.tensors if t.name in ("cls.weight", "cls.output.weight")}
        head = heads.get("cls.output.weight")
        if head is None:
            head = heads.get("cls.weight")
            if head is None or (len(head.shape) > 1 and head.shape[1] > 2):
                return 0
        arch = self.metadata.get("general.architecture")
        labels = self.metadata.get(f"{arch}.classifier.output_labels")
        if isinstance(labels, list) and labels:
            return len(labels)
        return head.shape[1] if len(head.shape) > 1 else 1

    @property
    def split_no(self) -> int:
        value = self.metadata.get("split.no", 0)
        return value if isinstance(value, int) else 0

    @property
    def split_count(self) -> int:
        value = self.metadata.get("split.count", 1)
        return value if isinstance(value, int) and value > 0 else 1


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a safetensors header; begin/end are relative to the data section."""

    name: str
    dtype: str  # safetensors spelling: "F16", "BF16", "I32", ...
    shape: tuple[int, ...]  # numpy order, as in the file
    begin: int
    end: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, eq=False)
class SafetensorsHeader:
    """The validated JSON header of one .safetensors file."""

    path: Path
    file_size: int
    header_size: int  # the u64 length prefix: bytes of JSON after the first 8
    metadata: dict[str, str]  # the optional "__metadata__" map
    tensors: dict[str, SafetensorsTensor]

    @property
    def data_offset(self) -> int:
        return 8 + self.header_size


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """What detect() found: the format, the weight files in load order, configs and quantization details.

    `quant` keys by format:
      gguf               {file_type, version}
      safetensors        {dtype}
      a quantized scheme its `describe()`, e.g. gptq {bits, group_size, sym, desc_act, checkpoint_format}
    """

    format: str
    path: Path  # what the caller passed
    files: tuple[Path, ...]
    config: dict[str, Any] | None
    quant: dict[str, Any]
    architecture: str | None
    scheme: QuantScheme | None = (
        None  # a quantized HF checkpoint's parsed config (quantserve.formats.schemes)
    )

    @property
    def directory(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent
