"""Qwen3.5 / 3.6, dense (`qwen35`) and MoE (`qwen35moe`): Gated DeltaNet layers among gated full-attention ones
(backends/torch/deltanet.py), as llama.cpp's converter writes them (conversion/qwen.py, Qwen3_5TextModel and its
bases Qwen3NextModel and Qwen2MoeModel), without the multi-token-prediction layers (its `--no-mtp`):

- every `*norm.weight` holds 1 + w, but the DeltaNet's gated norm (`linear_attn.norm`, which scales by w);
- a DeltaNet's `A_log` becomes `ssm_a` = -exp(A_log), `dt_bias` becomes `ssm_dt.bias`, and its conv1d weight
  [C, 1, k] loses the middle dimension;
- where there are more value heads than key heads, the value heads are regrouped from "grouped by key head"
  [K0: v0 v1 .., K1: v0 v1 ..] to "tiled" [v0 of K0, v0 of K1, .., v1 of K0, ..] (what ggml's broadcast repeats):
  the rows of in_proj_qkv's V part, in_proj_z, in_proj_a and in_proj_b, the V channels of the conv, A_log and
  dt_bias, and the columns of out_proj;
- the full-attention q_proj keeps each head's query and gate together, as the checkpoint has it;
- keys: the common ones, then the experts' widths (MoE), the DeltaNet's sizes, which layers are recurrent, the
  full-attention interval, the rotary dimensions (head_dim x partial_rotary_factor) and the M-RoPE sections.

The released checkpoints are Qwen3_5(Moe)ForConditionalGeneration: the text model under `model.language_model.`,
written here as the text GGUF (the vision tower, `model.visual.`, is left out: llama.cpp takes it as an mmproj,
which quantserve does not write for Qwen3.5 yet).

GGUF -> HF is not done (the regrouping and the recomputed A_log go one way here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from quantserve.gguf.archs import EXPERTS, ArchSpec
from quantserve.gguf.archs.qwen import QK_NORM

_DEFAULT_SECTIONS = [11, 11, 10, 0]  # llama.cpp's default when config.json names no mrope_section

_LAYER = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    *QK_NORM,
    ("linear_attn.A_log", "ssm_a"),
    ("linear_attn.conv1d.weight", "ssm_conv1d.weight"),
    ("linear_attn.dt_bias", "ssm_dt.bias"),
    ("linear_attn.in_proj_a.weight", "ssm_alpha.weight"),
    ("linear_attn.in_proj_b.weight", "ssm_beta.weight"),
    ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight"),
    ("linear_attn.in_proj_z.weight", "attn_gate.weight"),
    ("linear_attn.norm.weight", "ssm_norm.weight"),
    ("linear_attn.out_proj.weight", "ssm_out.weight"),
)
_DENSE_MLP = (
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
)
_MOE_MLP = (
    ("mlp.gate.weight", "ffn_gate_inp.weight"),
    ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
)


def _tiled(x: np.ndarray, axis: int, n_k: int, per_k: int, head: int) -> np.ndarray:
    """x with the n_k * per_k heads of `head` entries along `axis` regrouped from grouped to tiled order."""
    shape = x.shape
    x = x.reshape(*shape[:axis], n_k, per_k, head, *shape[axis + 1 :])
    return np.swapaxes(x, axis, axis + 1).reshape(shape)


def _in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """As the converter's arithmetic rounds: in float16 for an F16 checkpoint (it widens BF16 to float32 first)."""
    return x.astype(np.float16).astype(np.float32) if dtype == "F16" else x


def _neg_exp(x: np.ndarray) -> np.ndarray:
    """-exp(x) in float32 as torch computes it (the converter's arithmetic: numpy's exp can differ by an ulp)."""
    import torch

    return (-torch.exp(torch.from_numpy(np.ascontiguousarray(x)))).numpy()


def _transform(
    suffix: str, shape: tuple[int, ...], hp: Mapping[str, Any]
) -> tuple[tuple[int, ...], Callable[[np.ndarray, str], np.ndarray]] | None:
    if not suffix.startswith("linear_attn."):
        return None
    n_k, n_v = hp.get("linear_num_key_heads", 16), hp.get("linear_num_value_heads", 32)
    d_k, d_v = hp.get("linear_key_head_dim", 128), hp.get("linear_value_head_dim", 128)
    per_k = n_v // n_k

    def regroup(x: np.ndarray, axis: int, head: int, skip: int = 0) -> np.ndarray:
        """Regroup the value heads along `axis`, after its first `skip` entries (q and k rows)."""
        if per_k == 1:
            return x
        keep, v = np.split(x, [skip], axis=axis)
        return np.concatenate((keep, _tiled(v, axis, n_k, per_k, head)), axis=axis)

    name = suffix.removeprefix("linear_attn.")
    if name == "A_log":
        return shape, lambda x, dtype: _in_dtype(_neg_exp(regroup(x, 0, 1)), dtype)
    if name == "dt_bias" or name in ("in_proj_a.weight", "in_proj_b.weight"):
        return shape, lambda x, dtype: regroup(x, 0, 1)
    if name == "in_proj_qkv.weight":
        return shape, lambda x, dtype: regroup(x, 0, d_v, skip=2 * n_k * d_k)
    if name == "in_proj_z.weight":
        return shape, lambda x, dtype: regroup(x, 0, d_v)
    if name == "out_proj.weight":
        return shape, lambda x, dtype: regroup(x, 1, d_v)
    if name == "conv1d.weight":  # [C, 1, k] -> [C, k]
        return (shape[0], shape[-1]), lambda x, dtype: regroup(x.reshape(shape[0], shape[-1]), 0, d_v,
                                                               skip=2 * n_k * d_k)  # fmt: skip
    return None


def _params(writer: Any, hp: Mapping[str, Any]) -> None:
    """Qwen2MoeModel's, Qwen3NextModel's and the M-RoPE mixin's keys, after the common ones (conversion/qwen.py)."""
    if (n_ff := hp.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(n_ff)
    if (n_shared := hp.get("shared_expert_intermediate_size")) is not None:
        writer.add_expert_shared_feed_forward_length(n_shared)
    writer.add_ssm_conv_kernel(hp.get("linear_conv_kernel_dim", 4))
    writer.add_ssm_state_size(hp.get("linear_key_head_dim", 128))
    writer.add_ssm_group_count(hp.get("linear_num_key_heads", 16))
    writer.add_ssm_time_step_rank(hp.get("linear_num_value_heads", 32))
    writer.add_ssm_inner_size(hp.get("linear_value_head_dim", 128) * hp.get("linear_num_value_heads", 32))
    if (types := hp.get("layer_types")) is not None:
        # (gguf-py's add_recurrent_layers is newer than the pinned gguf package: the same key, by hand)
        writer.add_array(
            f"{writer.arch}.attention.recurrent_layers", [t == "linear_attention" for t in types]
        )
    writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    writer.add_rope_dimension_count(int(head_dim * hp["rope_parameters"].get("partial_rotary_factor", 0.25)))
    if "mrope_section" not in hp["rope_parameters"]:  # (the common keys wrote a config's own)
        writer.add_rope_dimension_sections(_DEFAULT_SECTIONS)


# what the dense and MoE files share: every DeltaNet rule above, written one way only
_HYBRID = dict(permute_qk=False, params_extra=_params, transform=_transform, norm_shift=1.0,
               norm_shift_skip=("linear_attn.norm.weight",), to_hf=False, torch=True)  # fmt: skip
QWEN3_5 = ArchSpec(
    gguf_arch="qwen35",
    hf_model_types=("qwen3_5_text", "qwen3_5"),  # the text model alone, or as released with its vision tower
    hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    layer_tensors=_LAYER + _DENSE_MLP,
    **_HYBRID,
)
QWEN3_5_MOE = ArchSpec(
    gguf_arch="qwen35moe",
    hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    layer_tensors=_LAYER + _MOE_MLP,
    experts=EXPERTS,
    **_HYBRID,
)
