"""Qwen2 (q/k/v biases) and Qwen3 (per-head RMSNorm on q and k): NEOX rope, so no q/k permutation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantserve.gguf.archs import DENSE_LAYER, QKV_BIAS, ArchSpec

QK_NORM = (
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
)


def _qwen_config(config: Mapping[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
    # Qwen2Config/Qwen3Config defaults; llama.cpp runs every layer with full attention
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config["num_hidden_layers"],
    }


def _qwen3_config(config: Mapping[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
    # Qwen3Config's head_dim defaults to 128, not hidden/heads: always spell it out
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return {**_qwen_config(config, tensor_names), "attention_bias": False, "head_dim": head_dim}


QWEN2 = ArchSpec(
    gguf_arch="qwen2",
    hf_model_types=("qwen2",),
    hf_architectures=("Qwen2ForCausalLM",),
    permute_qk=False,
    layer_tensors=DENSE_LAYER + QKV_BIAS,
    config_extra=_qwen_config,
    torch=True,
)
QWEN3 = ArchSpec(
    gguf_arch="qwen3",
    hf_model_types=("qwen3",),
    hf_architectures=("Qwen3ForCausalLM",),
    permute_qk=False,
    layer_tensors=DENSE_LAYER + QK_NORM,
    config_extra=_qwen3_config,
    torch=True,
)
