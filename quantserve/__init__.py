"""quantserve: a quantization-first local LLM runtime.

import quantserve
llm = quantserve.load("smollm2")   # a models.toml name, a path or a hub id
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "load", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import quantserve` (the CLI, the formats) does not load llama.cpp.
    if name in ("LLM", "load"):
        from quantserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'quantserve' has no attribute {name!r}")
