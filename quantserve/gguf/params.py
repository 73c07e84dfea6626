"""`{arch}.*` GGUF keys from an HF config.json, in the order and form llama.cpp's converter writes them.

Mirrors convert_hf_to_gguf.py's TextModel.__init__ (rope parameter normalisation) and set_gguf_parameters,
plus LlamaModel's extras (vocab_size, rope.dimension_count) and its llama3 `rope_freqs.weight`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.hf_config import GEMMA_DEFAULTS, is_llava
from quantserve.gguf.archs import ArchSpec, arch_for_hf

# transformers' LlamaConfig defaults. llava-hf's config.json leaves out of text_config what equals them (LLaVA 1.5:
# all but max_position_embeddings, rms_norm_eps and vocab_size); llama.cpp's converter sees them filled in, through
# AutoConfig.to_dict(), as does num_key_value_heads = num_attention_heads and head_dim = hidden / heads.
_LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}  # fmt: skip


def _llava_text_config(text: Mapping[str, Any]) -> dict[str, Any]:
    if text.get("model_type", "llama") != "llama":
        return dict(text)
    hp = {**_LLAMA_DEFAULTS, **text}  # a rope_theta inside rope_parameters still wins (normalize_hparams)
    hp.setdefault("num_key_value_heads", hp["num_attention_heads"])
    hp.setdefault("head_dim", hp["hidden_size"] // hp["num_attention_heads"])
    return hp


def normalize_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with `text_config` lifted to the top and HF's two rope spellings merged into
    `rope_parameters` (transformers >= 5 writes rope_parameters; older configs rope_theta + rope_scaling)."""
    hp = dict(config)
    if isinstance(hp.get("text_config"), dict):
        text = _llava_text_config(hp["text_config"]) if is_llava(config) else hp["text_config"]
        hp = {**hp, **text}
    if hp.get("model_type") in GEMMA_DEFAULTS:  # what AutoConfig fills in for llama.cpp's converter
        hp = {**GEMMA_DEFAULTS[hp["model_type"]], **hp}
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:  # one rope for every layer type
        if hp.get("rope_local_base_freq") is not None:  # Gemma 3's local base, before transformers 5
            rope["sliding_attention"] = {"rope_theta": hp["rope_local_base_freq"]}
        if "rope_theta" not in rope and hp.get("rope_theta") is not None:
            rope["rope_theta"] = hp["rope_theta"]
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
    hp["rope_parameters"] = rope
    return hp


def conversion_refusal(config: Mapping[str, Any]) -> str | None:
    """Why this HF config.json cannot become a GGUF that llama.cpp runs as the same model, or None if it can."""
    try:
        spec = arch_for_hf(config)
        if spec.check is not None:
            spec.check(normalize_hparams(config))
    except UnsupportedFormatError as e:
        return str(e)
    except (KeyError, TypeError, ValueError) as e:  # a malformed config: the load names what is wrong
        return f"config.json cannot be read for conversion ({e!r})"
    return None


def _find(hp: Mapping[str, Any], *keys: str) -> Any:
    return next((hp[k] for k in keys if hp.get(k) is not None), None)


def add_arch_params(writer: gguf.GGUFWriter, spec: ArchSpec, hp: Mapping[str, Any], ftype: int) -> None:
    """Write the architecture keys.

    Raises:
        ModelFileError: config.json lacks num_hidden_layers or another required size.
        UnsupportedFormatError: a rope scaling type llama.cpp cannot run for this arch.
    """
    if spec.params is not None:
        spec.params(writer, hp, ftype)
        return
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads"]
    if hp.get("moe_intermediate_size") is None:  # (a MoE whose every layer routes has no dense width)
        required.append("intermediate_size")
    for key in required:
        if hp.get(key) is None:
            raise ModelFileError(f"config.json has no '{key}'; it is required to convert this model")
    writer.add_block_count(hp["num_hidden_layers"])
    if (n_ctx := _find(hp, "max_position_embeddings", "n_ctx", "n_positions", "max_length")) is not None:
        writer.add_context_length(n_ctx)
    writer.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:
        writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    if hp.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp["rope_parameters"].get("full_attention", hp["rope_parameters"])  # Gemma 3's global layers
    rope_type, factor = rope.get("rope_type"), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif rope_type == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if (ext := rope.get("extrapolation_factor")) is not None:
            writer.add_rope_scaling_yarn_ext_factor(ext)
        if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            writer.add_rope_scaling_yarn_attn_factor(attn)
        if (beta_fast := rope.get("beta_fast")) is not None:
            writer.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := rope.get("beta_slow")) is not None:
            writer.add_rope_scaling_yarn_beta_slow(beta_slow)
    elif rope_type not in (None, "default", "llama3"):  # llama3 becomes the rope_freqs tensor instead
        raise UnsupportedFormatError(f"rope type {rope_type!r} is not supported for conversion to GGUF")
    if (
        sections := hp["rope_parameters"].get("mrope_section")
    ) is not None:  # padded to 4, as the converter does
        writer.add_rope_dimension_sections([*sections, 0, 0, 0, 0][:4])
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    if (local_theta := hp["rope_parameters"].get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local_theta)
    if (eps := _find(hp, "rms_norm_eps", "norm_eps")) is not None:
        writer.add_layer_norm_rms_eps(eps)
    if (n_experts := _find(hp, "num_local_experts", "num_experts", "n_routed_experts")) is not None:
        writer.add_expert_count(n_experts)
    if (n_used := _find(hp, "num_experts_per_tok", "num_experts_per_token", "top_k_experts")) is not None:
        writer.add_expert_used_count(n_used)
    if (head_dim := hp.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(ftype)
    spec.params_extra(writer, hp)
    if spec.llama_kv:
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(head_dim or hp["hidden_size"] // hp["num_attention_heads"])


def llama3_rope_freqs(hp: Mapping[str, Any]) -> np.ndarray | None:
    """llama.cpp's `rope_freqs.weight` for a llama3-scaled rope (conversion/llama.py), else None."""
    rope = hp["rope_parameters"]
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
