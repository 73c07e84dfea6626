"""Writing GGUF: HF safetensors → GGUF the way llama.cpp's convert_hf_to_gguf.py does, byte for byte.

archs/ maps tensor names and config keys per architecture (both conversion directions use it); params.py
and tokenizer.py fill the metadata; writer.py lays the file out; native_quant.py quantizes through ggml
itself; mmproj.py writes a LLaVA's vision projector. The llama.cpp backend converts on load with this
(quantserve.insitu); `quantserve convert` calls it.
"""

from __future__ import annotations

from quantserve.gguf.hf_to_gguf import hf_to_gguf
from quantserve.gguf.mmproj import hf_to_mmproj

__all__ = ["hf_to_gguf", "hf_to_mmproj"]
