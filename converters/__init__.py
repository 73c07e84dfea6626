"""Offline conversion: GGUF ⇄ HF and dense → quantized HF checkpoints (`quantserve convert`).

Only the CLI and these converters import this package; the runtime's own conversions live in
quantserve.gguf and quantserve.quant.
"""

from __future__ import annotations

from quantserve.converters.gguf import gguf_to_hf
from quantserve.gguf import hf_to_gguf

__all__ = ["gguf_to_hf", "hf_to_gguf"]
