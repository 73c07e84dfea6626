"""config.json, generation_config.json and README.md for an HF checkpoint, from a GGUF's metadata
(docs/gguf.md, "Llama metadata keys")."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.spec import GGUFInfo
from quantserve.gguf.archs import ArchSpec

log = logging.getLogger(__name__)
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _f32(value: float) -> float:
    """A GGUF float32 as the short decimal it came from (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _llama3_factors(factor: float, low: float, high: float, orig: int, theta: float, dim: int) -> np.ndarray:
    # llama.cpp conversion/llama.py generate_extra_tensors, which matches transformers' "llama3" rope
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _rope_scaling_from_freqs(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's baked `rope_freqs.weight` (docs/gguf.md, "Llama 3
    rope_freqs"): try the published Llama-3.1/3.2 settings; the factors pin down `factor` (their maximum)
    directly."""
    factor = float(factors.max())
    for orig in (8192, 4096, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            if np.allclose(_llama3_factors(factor, low, high, orig, theta, dim), factors, rtol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}  # fmt: skip
    return None


def hf_config(
    info: GGUFInfo,
    spec: ArchSpec,
    dtype: str,
    rope_freqs: np.ndarray | None,
    rope_factors: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The config.json object for this GGUF (`rope_factors`: LongRoPE's long and short factor tensors).

    Raises:
        ModelFileError: required `{arch}.*` keys are missing.
        UnsupportedFormatError: partial rotary embeddings, which the HF classes here cannot express.
    """
    md, arch = info.metadata, spec.gguf_arch

    def need(key: str) -> Any:
        value = md.get(f"{arch}.{key}")
        if value is None:
            raise ModelFileError(
                f"{info.path.name}: metadata key {arch}.{key} is missing; the GGUF is incomplete"
            )
        return value

    names = frozenset(t.name for t in info.tensors)
    embd = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelFileError(f"{info.path.name}: no token_embd.weight tensor; the GGUF is incomplete")
    hidden, n_head = need("embedding_length"), need("attention.head_count")
    head_dim = md.get(f"{arch}.attention.key_length", hidden // n_head)
    rope_dim = md.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedFormatError(
            f"{info.path.name}: rope.dimension_count {rope_dim} differs from the head size {head_dim} "
            "(partial rotary embeddings); HF conversion of this model is not supported"
        )
    theta = _f32(md.get(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.hf_model_types[0],
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": md.get(f"{arch}.attention.head_count_kv", n_head),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": need("context_length"),
        "vocab_size": embd.shape[1],  # rows of the embedding, which may exceed the token list
        "tie_word_embeddings": "output.weight" not in names,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": TORCH_DTYPES[dtype],
        "dtype": TORCH_DTYPES[dtype],  # transformers >= 4.56 spelling; older versions read torch_dtype
    }
    if head_dim != hidden // n_head:  # omitted otherwise so that HF→GGUF writes no attention.key_length
        config["head_dim"] = head_dim
    for key, gguf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        config[f"{key}_token_id"] = md.get(f"tokenizer.ggml.{gguf_key}")
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": _f32(md[f"{arch}.rope.scaling.factor"])}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = md.get(
                f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"]
            )
    elif rope_factors is not None:  # LongRoPE (Phi-3): the factors llama.cpp keeps as tensors
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [_f32(x) for x in rope_factors[0]],
            "short_factor": [_f32(x) for x in rope_factors[1]],
        }
    elif rope_freqs is not None:
        config["rope_scaling"] = _rope_scaling_from_freqs(rope_freqs, theta, head_dim)
        if config["rope_scaling"] is None:
            # the model is still right within its original context; only long-context scaling is lost
            log.warning("rope_freqs.weight matches no known llama3 rope scaling; rope_scaling left out")
    if (
        orig := md.get(f"{arch}.rope.scaling.original_context_length")
    ) is not None and "rope_scaling" not in config:
        config["original_max_position_embeddings"] = orig  # Phi-3 names it outside rope_scaling
    if rope_factors is not None and orig is not None:
        config["original_max_position_embeddings"] = orig
    if md.get(f"{arch}.attention.sliding_window"):  # 0 means none
        config["sliding_window"] = md[f"{arch}.attention.sliding_window"]
    if (n_experts := md.get(f"{arch}.expert_count")) is not None:  # a mixture of experts
        config[spec.expert_count_key] = n_experts
        config["num_experts_per_tok"] = need("expert_used_count")
        if (n_ff := md.get(f"{arch}.expert_feed_forward_length")) is not None:
            config["moe_intermediate_size"] = n_ff
    config.update(spec.config_extra(config, names))
    for key, value in (spec.gguf_config(md, config) if spec.gguf_config else {}).items():
        if value is None:
            config.pop(key, None)  # the HF class's default is llama.cpp's too
        else:
            config[key] = value
    return config


def generation_config(md: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: the special ids, plus llama.cpp's `general.sampling.*` defaults mapped back."""
    out: dict[str, Any] = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None
    }
    for key, value in md.items():
        if key.startswith("general.sampling."):
            name = key.removeprefix("general.sampling.")
            out[{"temp": "temperature"}.get(name, name)] = _f32(value) if isinstance(value, float) else value
    if any(k in out for k in ("temperature", "top_k", "top_p", "min_p")):
        out["do_sample"] = True
    return out


# general.* key -> model card front-matter key that llama.cpp's gguf.Metadata.load reads back (metadata.py)
_CARD_KEYS = {
    "name": "name", "author": "author", "version": "version", "organization": "organization",
    "description": "description", "finetune": "finetune", "basename": "basename", "size_label": "size_label",
    "license": "license", "license.name": "license_name", "license.link": "license_link", "url": "url",
    "doi": "doi", "uuid": "uuid", "repo_url": "repo_url", "tags": "tags", "languages": "language",
}  # fmt: skip


def model_card(md: Mapping[str, Any], source_name: str) -> str:
    """README.md whose YAML front matter keeps the GGUF's descriptive `general.*` keys for HF→GGUF."""
    lines = ["---"]
    for key, card_key in _CARD_KEYS.items():
        value = md.get(f"general.{key}")
        if isinstance(value, str | list) and value:
            lines.append(
                f"{card_key}: {json.dumps(value, ensure_ascii=False)}"
            )  # JSON scalars are valid YAML
    lines += [
        "---",
        "",
        f"Converted from `{source_name}` ({md.get('general.architecture')}) by quantserve.",
        "",
    ]
    return "\n".join(lines)
