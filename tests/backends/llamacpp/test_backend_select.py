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


def test_auto_takes_torch_for_a_checkpoint_llama_cpp_would_run_differently(monkeypatch):
    """A Gemma 3 whose attention scale is not llama.cpp's 1/sqrt(head_dim): conversion would refuse it, so auto
    serves it with the torch backend even without a GPU; the same model with llama.cpp's scale goes to llama.cpp."""
    monkeypatch.setattr(select, "_cuda", lambda: False)
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 6,
              "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "sliding_window": 4}  # fmt: skip
    ok = ModelSpec("safetensors", Path("m"), (), {**config, "query_pre_attn_scalar": 32}, {}, None)
    assert select.choose_backend(ok, "auto")[0] == "llamacpp"
    bad = ModelSpec("safetensors", Path("m"), (), {**config, "query_pre_attn_scalar": 24}, {}, None)
    name, reason = select.choose_backend(bad, "auto")
    assert name == "torch" and "query_pre_attn_scalar 24" in reason
