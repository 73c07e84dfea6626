"""Qwen2 (q/k/v biases), Qwen3 (per-head RMSNorm on q and k) and Qwen3-MoE (Qwen3's attention, a softmax top-k
router over experts): NEOX rope, so no q/k permutation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantserve.errors import UnsupportedFormatError
from quantserve.gguf.archs import DENSE_LAYER, EXPERTS, QKV_BIAS, ROUTER, ArchSpec

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


def _qwen3_moe_config(config: Mapping[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
    # llama.cpp's qwen3moe runs every layer as MoE and renormalises the top-k weights (Qwen3MoeConfig's defaults)
    return {
        **_qwen3_config(config, tensor_names),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _moe_params(writer: Any, hp: Mapping[str, Any]) -> None:
    """Qwen2MoeModel.set_gguf_parameters' own keys (conversion/qwen.py), written after the common ones.

    Raises:
        UnsupportedFormatError: a model llama.cpp's qwen3moe would run differently: it always renormalises the
            top-k routing weights (src/models/qwen3moe.cpp) and runs every layer as MoE.
    """
    if hp.get("norm_topk_prob") is False:
        raise UnsupportedFormatError(
            "config.json has norm_topk_prob false, but llama.cpp's qwen3moe always renormalises the top-k expert "
            "weights, so the GGUF would compute a different model; the released Qwen3 MoE models set it true"
        )
    if hp.get("mlp_only_layers") or hp.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedFormatError(
            "config.json has dense layers among the MoE ones (mlp_only_layers / decoder_sparse_step), which "
            "llama.cpp's qwen3moe does not run"
        )
    if (n_ff := hp.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(n_ff)
    if (n_shared := hp.get("shared_expert_intermediate_size")) is not None:
        writer.add_expert_shared_feed_forward_length(n_shared)


QWEN3_MOE = ArchSpec(
    gguf_arch="qwen3moe",
    hf_model_types=("qwen3_moe",),
    hf_architectures=("Qwen3MoeForCausalLM",),
    permute_qk=False,
    layer_tensors=DENSE_LAYER[:6] + QK_NORM + ROUTER,  # no dense MLP: every layer is MoE in llama.cpp
    config_extra=_qwen3_moe_config,
    experts=EXPERTS,
    params_extra=_moe_params,
    torch=True,
)
