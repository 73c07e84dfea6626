"""Offline format converters."""

from __future__ import annotations

# importing an arch module registers it (archs.register); keep these before the converters that look archs up
from . import arch_llama, arch_qwen  # noqa: F401
from .gguf_to_hf import gguf_to_hf
from .hf_to_gguf import hf_to_gguf

__all__ = ["gguf_to_hf", "hf_to_gguf"]
