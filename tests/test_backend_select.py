"""`--backend auto`: which backend serves which checkpoint, with and without CUDA, and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantserve.backends import select
from quantserve.errors import BackendUnavailableError
from quantserve.formats.spec import ModelSpec


def spec(fmt: str, arch: str | None = "LlamaForCausalLM") -> ModelSpec:
    config = {"architectures": [arch]} if arch else {}
    return ModelSpec(fmt, Path("m"), (), config, {}, None)


@pytest.mark.parametrize(
    ("fmt", "arch", "quant", "cuda", "want"),
    [
        ("gguf", None, None, True, "llamacpp"),
        ("safetensors", "LlamaForCausalLM", None, True, "torch"),
        ("safetensors", "LlamaForCausalLM", None, False, "llamacpp"),
        ("safetensors", "LlamaForCausalLM", "q4_k_m", True, "llamacpp"),  # a GGUF type: only llama.cpp has it
        ("safetensors", "LlamaForCausalLM", "int4", False, "torch"),  # only the torch backend has int4
        ("safetensors", "GemmaForCausalLM", None, True, "llamacpp"),  # not implemented by the torch model
        ("gptq", "Qwen2ForCausalLM", None, True, "torch"),
        ("awq", "LlamaForCausalLM", None, False, "llamacpp"),  # dequantized, then q8_0 GGUF
    ],
)
def test_auto(monkeypatch, fmt, arch, quant, cuda, want):
    monkeypatch.setattr(select, "_cuda", lambda: cuda)
    name, reason = select.choose_backend(spec(fmt, arch), "auto", quant)
    assert name == want and reason


def test_explicit_and_unknown():
    assert select.choose_backend(spec("gguf"), "torch") == ("torch", "asked for")
    with pytest.raises(BackendUnavailableError, match="choose one of"):
        select.choose_backend(spec("gguf"), "tensorrt")
