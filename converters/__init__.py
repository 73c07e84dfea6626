"""Offline conversion: GGUF ⇄ HF and dense → quantized HF checkpoints (`quantserve convert`).

Only the CLI and these converters import this package; the runtime's own conversions live in
quantserve.gguf and quantserve.quant.
"""

from __future__ import annotations

from quantserve.converters.gguf import gguf_to_hf
from quantserve.converters.llava import LlavaGGUF, llava_to_gguf
from quantserve.gguf import hf_to_gguf, hf_to_mmproj

__all__ = ["LlavaGGUF", "gguf_to_hf", "hf_to_gguf", "hf_to_mmproj", "llava_to_gguf"]
