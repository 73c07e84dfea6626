"""Model file formats: detect a checkpoint's format and read GGUF / safetensors headers safely."""

from __future__ import annotations

from quantserve.formats.detect import detect
from quantserve.formats.gguf import parse_gguf_bytes, read_gguf_info
from quantserve.formats.mmproj import find_mmproj, is_mmproj
from quantserve.formats.safetensors_header import parse_safetensors_header, read_safetensors_header
from quantserve.formats.spec import (
    GGUFInfo,
    GGUFTensorInfo,
    ModelSpec,
    SafetensorsHeader,
    SafetensorsTensor,
)
from quantserve.formats.summary import ModelSummary, render_summary, summarize

__all__ = [
    "GGUFInfo",
    "GGUFTensorInfo",
    "ModelSpec",
    "ModelSummary",
    "SafetensorsHeader",
    "SafetensorsTensor",
    "detect",
    "find_mmproj",
    "is_mmproj",
    "parse_gguf_bytes",
    "parse_safetensors_header",
    "read_gguf_info",
    "read_safetensors_header",
    "render_summary",
    "summarize",
]
