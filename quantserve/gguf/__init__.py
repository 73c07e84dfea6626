"""Writing GGUF: HF safetensors → GGUF the way llama.cpp's convert_hf_to_gguf.py does, byte for byte.

archs/ maps tensor names and config keys per architecture (both conversion directions use it); params.py
and tokenizer.py fill the metadata; writer.py lays the file out; native_quant.py quantizes through ggml
itself; mmproj.py writes a LLaVA's vision projector. The llama.cpp backend converts on load with this
(quantserve.insitu); `quantserve convert` calls it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hf_to_gguf", "hf_to_mmproj"]


def __getattr__(name: str) -> Any:
    """The writers, imported on first use: the architecture registry (archs/) is read by the backends' plans,
    which must not pay for importing the writers (and llama.cpp, which native_quant.py loads)."""
    if name == "hf_to_gguf":
        from quantserve.gguf.hf_to_gguf import hf_to_gguf as found
    elif name == "hf_to_mmproj":
        from quantserve.gguf.mmproj import hf_to_mmproj as found
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = (
        found  # importing the submodule hf_to_gguf bound its name to the module: the function wins
    )
    return found
