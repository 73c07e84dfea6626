"""How big a model's KV cache will be, from its metadata alone (a GGUF's or an HF config's), before anything is
loaded: read by the router's memory estimate (server/memory.py) and by llama.cpp's GPU layer fitting
(backends/llamacpp/offload.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantserve.core.settings import EngineSettings
from quantserve.formats import ModelSpec, read_gguf_info

# Bytes per element of llama.cpp's KV cache types (ggml's block sizes: q8_0 is 34 bytes per 32 values, ...).
KV_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32}
KV_TYPE_BYTES |= {"q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}


@dataclass(frozen=True)
class Shape:
    """The few hyperparameters the KV cache's size follows from."""

    n_layer: int
    kv_heads: int  # summed over the layers (llama.cpp allows a per-layer head_count_kv array)
    head_dim: int
    n_ctx_train: int | None


def _kv_heads(value: Any, n_layer: int) -> int:
    return sum(value) if isinstance(value, list) else value * n_layer


def gguf_shape(meta: dict[str, Any]) -> Shape:
    """From a GGUF's metadata. Raises KeyError, TypeError or ZeroDivisionError when it does not say."""
    arch = meta.get("general.architecture")
    n_head = meta.get(f"{arch}.attention.head_count")
    n_embd = meta.get(f"{arch}.embedding_length")
    n_layer = meta[f"{arch}.block_count"]
    head = max(n_head) if isinstance(n_head, list) else n_head
    return Shape(
        n_layer,
        _kv_heads(meta.get(f"{arch}.attention.head_count_kv", n_head), n_layer),
        meta.get(f"{arch}.attention.key_length") or n_embd // head,
        meta.get(f"{arch}.context_length"),
    )


def model_shape(spec: ModelSpec) -> Shape | None:
    """From a GGUF's metadata or an HF config (a LLaVA's text model); None when neither says."""
    try:
        if spec.format == "gguf":
            return gguf_shape(read_gguf_info(spec.files[0]).metadata)
        config: dict[str, Any] = dict(spec.config or {})
        config = config.get("text_config") or config
        n_head = config["num_attention_heads"]
        n_layer = config["num_hidden_layers"]
        return Shape(
            n_layer,
            (config.get("num_key_value_heads") or n_head) * n_layer,
            config.get("head_dim") or config["hidden_size"] // n_head,
            config.get("max_position_embeddings"),
        )
    except (KeyError, TypeError, ZeroDivisionError, ValueError):
        return None


def n_ctx(shape: Shape | None, settings: EngineSettings) -> int:
    return settings.n_ctx(shape.n_ctx_train if shape is not None else None)


def kv_cells(shape: Shape | None, settings: EngineSettings, backend: str) -> int:
    """KV cells the backend allocates: llama.cpp's shared pool, else --kv-size or n_ctx per sequence."""
    ctx = n_ctx(shape, settings)
    if backend == "llamacpp" and settings.llamacpp.kv_unified:
        return max(settings.kv_size or 2 * ctx, ctx)
    return settings.kv_size or ctx * settings.max_num_seqs


def kv_bytes(shape: Shape, settings: EngineSettings, backend: str) -> int:
    """The whole KV cache in bytes: K and V over every layer's heads, at the cache types llama.cpp is given
    (the torch backend keeps half precision)."""
    if backend == "llamacpp":
        k, v = settings.llamacpp.cache_type_k, settings.llamacpp.cache_type_v
        per_elem = (KV_TYPE_BYTES.get(k.lower(), 2) + KV_TYPE_BYTES.get(v.lower(), 2)) / 2
    else:
        per_elem = 2.0
    return int(2 * shape.kv_heads * shape.head_dim * kv_cells(shape, settings, backend) * per_elem)
