"""quantserve: a quantization-first local LLM runtime."""

__version__ = "0.1.0"
