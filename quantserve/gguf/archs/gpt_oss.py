"""gpt-oss: attention with biases and sinks, windowed and full layers alternating, and a biased MoE whose experts
the checkpoint stacks itself (backends/torch/gpt_oss.py).

As llama.cpp's converter writes it (conversion/gpt_oss.py): the sinks become `attn_sinks.weight`; gate|up, whose
gate is in the even output rows and up in the odd ones, splits into `ffn_gate_exps` and `ffn_up_exps` (weights and
biases); a float expert weight [E, in, out] is transposed to a linear's [E, out, in]; MXFP4 experts are kept
MXFP4, repacked into ggml's blocks (quantserve.gguf.writer) and written before every other tensor; the file type
of a float output is then MOSTLY_MXFP4_MOE. The window and the experts' width are its own keys. A checkpoint
llama.cpp would run differently is refused (`_check`), and `--backend auto` then serves it with the torch backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantserve.errors import UnsupportedFormatError
from quantserve.gguf.archs import ArchSpec

_EVEN, _ODD, _ALL = (0, 2), (1, 2), (0, 1)  # the output rows a part takes: (first, step)


def _check(hp: Mapping[str, Any]) -> None:
    """Raises UnsupportedFormatError for a gpt-oss llama.cpp would run as another model: its openai-moe graph
    fixes the SwiGLU's alpha at 1.702 and limit at 7 (llama-graph.cpp), and windows every other layer from the
    first (load_swa_pattern with a period of 2)."""
    alpha, limit = hp.get("swiglu_alpha", 1.702), hp.get("swiglu_limit", 7.0)
    if (alpha, limit) != (1.702, 7.0):
        raise UnsupportedFormatError(
            f"config.json's swiglu_alpha {alpha} and swiglu_limit {limit}: llama.cpp runs gpt-oss with 1.702 and 7.0, "
            "so the GGUF would compute another model; serve the checkpoint with --backend torch"
        )
    n = hp["num_hidden_layers"]
    types = hp.get("layer_types")
    if types is not None and list(types) != [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
    ]:
        raise UnsupportedFormatError(
            "config.json's layer_types do not alternate windowed and full layers from a windowed first one, which "
            "is how llama.cpp runs gpt-oss; serve the checkpoint with --backend torch"
        )


def _params(writer: Any, hp: Mapping[str, Any]) -> None:
    writer.add_sliding_window(hp["sliding_window"])
    writer.add_expert_feed_forward_length(hp["intermediate_size"])


GPT_OSS = ArchSpec(
    gguf_arch="gpt-oss",
    hf_model_types=("gpt_oss",),
    hf_architectures=("GptOssForCausalLM",),
    permute_qk=False,
    layer_tensors=(
        ("input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.v_proj.bias", "attn_v.bias"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("self_attn.o_proj.bias", "attn_output.bias"),
        ("self_attn.sinks", "attn_sinks.weight"),
        ("post_attention_layernorm.weight", "post_attention_norm.weight"),
        ("mlp.router.weight", "ffn_gate_inp.weight"),
        ("mlp.router.bias", "ffn_gate_inp.bias"),
    ),
    stacked=(
        ("mlp.experts.gate_up_proj", (("ffn_gate_exps.weight", _EVEN), ("ffn_up_exps.weight", _ODD))),
        ("mlp.experts.gate_up_proj_bias", (("ffn_gate_exps.bias", _EVEN), ("ffn_up_exps.bias", _ODD))),
        ("mlp.experts.down_proj", (("ffn_down_exps.weight", _ALL),)),
        ("mlp.experts.down_proj_bias", (("ffn_down_exps.bias", _ALL),)),
    ),
    params_extra=_params,
    check=_check,
    to_hf=False,
    torch=True,
)
