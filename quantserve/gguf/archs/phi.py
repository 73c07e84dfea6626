"""Phi-3 / 3.5 and Phi-4 (mini): q|k|v and gate|up fused in the checkpoint and kept fused in the GGUF (attn_qkv,
and ffn_up holding gate and up), NEOX rope over `partial_rotary_factor` of each head, and LongRoPE's short and long
factors as two tensors. Its converter writes its own keys, in its own order (conversion/phi.py, Phi3MiniModel)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.gguf.archs import ArchSpec

LAYER = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
)


def _rope(hp: Mapping[str, Any]) -> tuple[dict[str, Any], int, int]:
    """The rope parameters, the original context and the rotated dimensions per head.

    Raises:
        ModelFileError: no original context (Phi-3's configs name it).
    """
    rope = hp["rope_parameters"]
    orig = rope.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    if orig is None:
        raise ModelFileError("config.json has no original_max_position_embeddings; Phi-3's configs always do")
    n_embd, n_head = hp["hidden_size"], hp["num_attention_heads"]
    rot = rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0))
    return rope, orig, int(rot * n_embd) // n_head


def _params(writer: Any, hp: Mapping[str, Any], ftype: int) -> None:
    """Phi3MiniModel.set_gguf_parameters' keys, in its order."""
    rope, orig, rope_dims = _rope(hp)
    writer.add_context_length(hp.get("max_position_embeddings", hp.get("n_positions")))
    writer.add_rope_scaling_orig_ctx_len(orig)
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_file_type(ftype)
    writer.add_sliding_window(hp.get("sliding_window") or 0)  # 0: no window (Phi-4), as llama.cpp's converter


def _first_keys(writer: Any, hp: Mapping[str, Any]) -> None:
    """A LongRoPE model's attention factor, which Phi3MiniModel writes as it makes the factor tensors."""
    rope, orig, _ = _rope(hp)
    if rope.get("long_factor"):
        writer.add_rope_scaling_attn_factors(_attn_factor(hp, rope, orig))


def _attn_factor(hp: Mapping[str, Any], rope: Mapping[str, Any], orig: int) -> float:
    scale = hp["max_position_embeddings"] / orig
    kind = str(rope.get("rope_type", "")).lower()
    if kind in ("su", "longrope"):
        return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    if kind == "yarn":
        return 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    raise UnsupportedFormatError(
        f"rope type {kind!r} is not supported for Phi-3 (llama.cpp runs longrope and yarn)"
    )


def _rope_factors(hp: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """LongRoPE's factors, one per rotated pair (Phi3MiniModel.generate_extra_tensors)."""
    rope, _, rope_dims = _rope(hp)
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if not long:
        return []
    if not short or len(long) != len(short) or len(long) != rope_dims // 2:
        raise ModelFileError(
            f"config.json's rope long_factor and short_factor must both hold {rope_dims // 2} values (one per "
            "rotated pair of a head)"
        )
    f32 = np.float32
    return [
        ("rope_factors_long.weight", np.array(long, f32)),
        ("rope_factors_short.weight", np.array(short, f32)),
    ]


PHI3 = ArchSpec(
    gguf_arch="phi3",
    hf_model_types=("phi3",),
    hf_architectures=("Phi3ForCausalLM",),
    permute_qk=False,
    layer_tensors=LAYER,
    params=_params,
    extra_tensors=_rope_factors,
    first_keys=_first_keys,
    torch=True,
)
