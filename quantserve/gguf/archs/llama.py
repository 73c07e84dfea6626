"""Llama (and Mistral and Mixtral, which llama.cpp stores as llama): rotate-half q/k rows interleaved in the GGUF."""

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
# both (conversion/llama.py registers "MistralForCausalLM") and ignores `sliding_window`, as this conversion does.
# (The torch backend honours the window: a Mistral 7B v0.1 differs between the two past 4096 tokens.)
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


def _mixtral_config(config: Mapping[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
    # MixtralConfig's defaults; llama.cpp runs full attention (Mixtral's released configs have no window)
    return {"sliding_window": None, "router_jitter_noise": 0.0}


# Mixtral: Llama's attention, a softmax top-2 router over expert MLPs (w1 gate, w2 down, w3 up), which llama.cpp's
# LlamaModel stacks (conversion/llama.py) in the order w1, w2, w3.
MIXTRAL = ArchSpec(
    gguf_arch="llama",
    hf_model_types=("mixtral",),
    hf_architectures=("MixtralForCausalLM",),
    permute_qk=True,
    layer_tensors=(
        ("input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
    ),
    llama_kv=True,
    config_extra=_mixtral_config,
    experts=(
        ("w1.weight", "ffn_gate_exps.weight"),
        ("w2.weight", "ffn_down_exps.weight"),
        ("w3.weight", "ffn_up_exps.weight"),
    ),
    expert_prefix="block_sparse_moe.experts",
    expert_count_key="num_local_experts",
    torch=True,
)
