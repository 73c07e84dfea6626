"""Gemma 2 and Gemma 3 (text, and the language model of Gemma3ForConditionalGeneration), as llama.cpp's GemmaModel
classes write them (conversion/gemma.py): (1 + w) norms stored with the 1 added, norms around attention and the MLP,
NEOX rope, Gemma 3's q/k norms and local rope base, and its embedding cut to the tokenizer's rows.

llama.cpp fixes what transformers reads from the config: the attention scale is 1/sqrt(head_dim) (1/sqrt(hidden /
heads) for the 27B models), and which layers are windowed follows a fixed period (Gemma 2 alternates; Gemma 3 has
five windowed layers to one global). A checkpoint that differs would compute another model, so it is refused."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.hf_config import layer_windows
from quantserve.gguf.archs import ArchSpec

LAYER = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
)
QK_NORM = (
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
)
# llama.cpp's layer counts of the 27B models, whose attention scale is 1/sqrt(hidden / heads) (src/models/gemma*.cpp)
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# how often a layer attends globally in llama.cpp (load_swa_pattern's default for each arch)
_PERIOD = {"gemma2": 2, "gemma3": 6}


def _check(hp: Mapping[str, Any], arch: str) -> None:
    """Raises UnsupportedFormatError for a config llama.cpp's `arch` would run as a different model."""
    theta = hp["rope_parameters"].get("rope_theta", 10000.0)
    if arch == "gemma2" and theta != 10000.0:
        raise UnsupportedFormatError(
            f"config.json has rope_theta {theta}; llama.cpp's gemma2 runs 10000 (its converter writes none)"
        )
    if arch == "gemma3" and hp.get("attn_logit_softcapping"):
        raise UnsupportedFormatError(
            "config.json caps Gemma 3's attention logits, which llama.cpp's gemma3 does not"
        )
    act = hp.get("hidden_activation") or hp.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedFormatError(f"Gemma with activation {act!r}: llama.cpp runs gelu_pytorch_tanh")
    head_dim, n_layer = hp["head_dim"], hp["num_hidden_layers"]
    scale_dim = hp["hidden_size"] // hp["num_attention_heads"] if n_layer == _27B_LAYERS[arch] else head_dim
    if hp.get("query_pre_attn_scalar", scale_dim) != scale_dim:
        raise UnsupportedFormatError(
            f"config.json has query_pre_attn_scalar {hp['query_pre_attn_scalar']}, but llama.cpp's {arch} scales "
            f"attention by 1/sqrt({scale_dim}) for a {n_layer}-layer model; serve it with --backend torch"
        )
    period = _PERIOD[arch]
    windows = layer_windows({**hp, "architectures": [_ARCH_NAMES[arch]]})
    if arch == "gemma3" and hp.get("sliding_window_pattern") == 1 and not any(windows):
        return  # every layer global: llama.cpp's converter then writes no window, and runs none
    theirs = tuple(0 if (i + 1) % period == 0 else hp["sliding_window"] for i in range(n_layer))
    if windows and windows != theirs:
        raise UnsupportedFormatError(
            f"config.json's windowed layers {[int(w > 0) for w in windows]} differ from llama.cpp's {arch}, which "
            f"makes every {period}th layer global; serve it with --backend torch"
        )


def _gemma2_params(writer: Any, hp: Mapping[str, Any], ftype: int) -> None:
    """Gemma2Model.set_gguf_parameters' keys, in its order (it writes no rope base: llama.cpp's default, 10000)."""
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp.get("num_key_value_heads") or hp["num_attention_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_file_type(ftype)
    writer.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    writer.add_sliding_window(hp["sliding_window"])


def _gemma3_params(writer: Any, hp: Mapping[str, Any]) -> None:
    """Gemma3Model.set_gguf_parameters' own keys, after the common ones (those it writes again keep their place)."""
    if final := hp.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(final)
    if hp.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hp["sliding_window"])


def _gemma3_rows(model_dir: Path) -> int | None:
    """How many embedding rows Gemma3Model keeps: the tokenizer's (its vocab and added tokens), not config.json's
    vocab_size, which pads past them."""
    path = model_dir / "tokenizer.json"
    if (model_dir / "tokenizer.model").is_file() or not path.is_file():
        return None  # llama.cpp counts SentencePiece's pieces, padded to vocab_size: every row
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
        return len(tok["model"]["vocab"]) + len(tok.get("added_tokens") or [])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(
            f"{path}: cannot read its vocabulary ({e}); fix or re-download the file"
        ) from None


def _vocab(directory: Path, hp: Mapping[str, Any]) -> Any:
    """With a tokenizer.model, the SentencePiece vocab llama.cpp's Gemma converters write from it (and
    add_space_prefix false after it); without one, None: tokenizer.json's (llama.cpp's Gemma 3 reads its byte-level
    BPE; its Gemma 2 needs tokenizer.model)."""
    if not (directory / "tokenizer.model").is_file():
        return None
    from quantserve.gguf.spm import spm_vocab

    return spm_vocab(directory, hp, space_prefix=False)


def _gguf_config(md: Mapping[str, Any], config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """config.json's Gemma fields from a gemma2/gemma3 GGUF, with each layer's type spelled out."""
    n_layer, window = config["num_hidden_layers"], md.get(f"{arch}.attention.sliding_window")
    if arch == "gemma2" and window is None:
        window = 4096  # what llama.cpp's gemma2 runs without the key (src/models/gemma2.cpp)
    scale_dim = config["hidden_size"] // config["num_attention_heads"]
    head_dim = config.get("head_dim", scale_dim)
    period = _PERIOD[arch] if window else 1
    out: dict[str, Any] = {
        "head_dim": head_dim,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scale_dim if n_layer == _27B_LAYERS[arch] else head_dim,
        "sliding_window": window or None,
        "layer_types": [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layer)
        ],
        "attn_logit_softcapping": md.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": md.get(f"{arch}.final_logit_softcapping"),
        "attention_bias": False,
    }
    # Gemma 3's local base, beside rope_theta / rope_scaling (the global layers'): transformers 4 and 5 read these
    if arch == "gemma3":
        out["rope_local_base_freq"] = md.get("gemma3.rope.freq_base_swa", 10000.0)
    return out


_ARCH_NAMES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

GEMMA2 = ArchSpec(
    gguf_arch="gemma2",
    hf_model_types=("gemma2",),
    hf_architectures=("Gemma2ForCausalLM",),
    permute_qk=False,
    layer_tensors=LAYER,
    params=_gemma2_params,
    check=lambda hp: _check(hp, "gemma2"),
    norm_shift=1.0,
    skip_tensors=("lm_head.weight",),
    gguf_config=lambda md, config: _gguf_config(md, config, "gemma2"),
    vocab=_vocab,
    torch=True,
)
GEMMA3 = ArchSpec(
    gguf_arch="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    permute_qk=False,
    layer_tensors=LAYER + QK_NORM,
    params_extra=_gemma3_params,
    check=lambda hp: _check(hp, "gemma3"),
    norm_shift=1.0,
    vocab_rows=_gemma3_rows,
    gguf_config=lambda md, config: _gguf_config(md, config, "gemma3"),
    vocab=_vocab,
    torch=True,
)
