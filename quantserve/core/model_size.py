"""How big a model's KV cache will be, from its metadata alone (a GGUF's or an HF config's), before anything is
loaded: the KV part of a ModelPlan (core/plan.py), which the runners allocate and llama.cpp's GPU layer fitting
(backends/llamacpp/offload.py) reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantserve.core.plan import KVPlan
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
        types = config.get("layer_types")  # Qwen3.5's linear-attention layers keep no KV
        attn = sum(t != "linear_attention" for t in types) if isinstance(types, list) else n_layer
        if not isinstance(types, list) and "linear_num_value_heads" in config:  # every 4th layer attends
            attn = n_layer // int(config.get("full_attention_interval", 4))
        return Shape(
            n_layer,
            (config.get("num_key_value_heads") or n_head) * attn,
            config.get("head_dim") or config["hidden_size"] // n_head,
            config.get("max_position_embeddings"),
        )
    except (KeyError, TypeError, ZeroDivisionError, ValueError):
        return None


def n_ctx(shape: Shape | None, settings: EngineSettings) -> int:
    return settings.n_ctx(shape.n_ctx_train if shape is not None else None)


def llamacpp_kv(shape: Shape, settings: EngineSettings, *, n_ctx_cap: int | None = None) -> KVPlan:
    """llama.cpp's cache: per-sequence streams of n_ctx cells each, or one shared pool (kv_unified) of --kv-size
    cells (default 2 x n_ctx, at least n_ctx), at the cache types it is given. `n_ctx_cap`: a reranker reads no
    further than its learned positions."""
    ctx = n_ctx(shape, settings)
    if n_ctx_cap is not None:
        ctx = min(ctx, n_ctx_cap)
    if settings.llamacpp.kv_unified:
        cells = max(settings.kv_size or 2 * ctx, ctx)
    else:
        cells = ctx * settings.max_num_seqs
    k, v = settings.llamacpp.cache_type_k, settings.llamacpp.cache_type_v
    per_elem = (KV_TYPE_BYTES.get(k.lower(), 2) + KV_TYPE_BYTES.get(v.lower(), 2)) / 2
    return KVPlan(ctx, cells, int(2 * shape.kv_heads * shape.head_dim * per_elem), "slots")


def torch_kv(shape: Shape, settings: EngineSettings, *, elem_bytes: int, fill_gpu: bool) -> KVPlan:
    """The torch backend's paged cache: --kv-size tokens, else (`fill_gpu`: on CUDA with kv_fill_gpu) what the
    GPU's free memory holds, measured at load, else room for max_num_seqs sequences at full context; whole
    blocks."""
    ctx = n_ctx(shape, settings)
    block = settings.torch.block_size
    if settings.kv_size:
        cells: int | None = -(-settings.kv_size // block) * block
    elif fill_gpu:
        cells = None
    else:
        cells = -(-ctx * settings.max_num_seqs // block) * block
    return KVPlan(ctx, cells, 2 * shape.kv_heads * shape.head_dim * elem_bytes, "paged")


def layer_kv_bytes(shape: Shape, kv: KVPlan) -> int:
    """One layer's share of the cache (llama.cpp's GPU layer fitting)."""
    return (kv.bytes or 0) // max(1, shape.n_layer)
