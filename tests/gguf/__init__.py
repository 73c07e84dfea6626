"""Tests of quantserve.gguf: HF <-> GGUF conversion per family, tokenizers, GPTQ, against llama.cpp."""
