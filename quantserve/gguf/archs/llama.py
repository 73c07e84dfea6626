"""Llama (and Mistral, which llama.cpp stores as llama): rotate-half q/k rows interleaved in the GGUF."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantserve.gguf.archs import DENSE_LAYER, QKV_BIAS, ArchSpec


def _llama_config(config: Mapping[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
    # LlamaConfig's optional biases (attention_bias covers q, k, v and o; llama.cpp maps q/k/v only)
    return {
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensor_names),
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


# MistralForCausalLM without sliding-window attention is the same network; llama.cpp's LlamaModel converts
# both (conversion/llama.py registers "MistralForCausalLM") and ignores `sliding_window`, as we do.
LLAMA = ArchSpec(
    gguf_arch="llama",
    hf_model_types=("llama", "mistral"),
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    permute_qk=True,
    layer_tensors=DENSE_LAYER + QKV_BIAS,
    llama_kv=True,
    config_extra=_llama_config,
    torch=True,
)
