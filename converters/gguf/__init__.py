"""GGUF → HF: a transformers-loadable directory (safetensors, config.json, tokenizer) from a GGUF file."""

from __future__ import annotations

from quantserve.converters.gguf.to_hf import gguf_to_hf

__all__ = ["gguf_to_hf"]
