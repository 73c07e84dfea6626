"""What a model will take before it is loaded (weights plus KV cache), and what memory is free: the router's
basis for unloading models to make room (--memory-budget)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantserve.core.settings import EngineSettings
from quantserve.formats import ModelSpec, read_gguf_info

_SOURCE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "float32": 32, "float16": 16, "bfloat16": 16}
_KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32}
_KV_BYTES |= {"q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}


@dataclass(frozen=True)
class Shape:
    """The few hyperparameters the KV cache's size follows from."""

    n_layer: int
    kv_heads: int  # summed over the layers (llama.cpp allows a per-layer head_count_kv array)
    head_dim: int
    n_ctx_train: int | None


def _kv_heads(value: Any, n_layer: int) -> int:
    return sum(value) if isinstance(value, list) else value * n_layer


def model_shape(spec: ModelSpec) -> Shape | None:
    """From a GGUF's metadata or an HF config (a LLaVA's text model); None when neither says."""
    try:
        if spec.format == "gguf":
            meta = read_gguf_info(spec.files[0]).metadata
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


def _target_bits(quant: str | None) -> float | None:
    """Bits per weight of what a dense checkpoint becomes at load; None: it is served as it is."""
    if not quant:
        return None
    if quant.lower() == "int4":  # the torch backend's in-situ W4A16, group 128, plus its scales
        return 4.25
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    from quantserve.errors import ConfigError
    from quantserve.gguf.quant_types import parse_quant

    try:
        target = parse_quant(quant)
    except ConfigError:
        return None  # the load itself says what is wrong with it
    main = target.direct
    if main is None and target.name[2:4] == "_k":  # a k-quant mix: its main type (q4_k_m -> Q4_K)
        main = T[target.name[:4].upper()]
    if main is None:
        return None
    block, size = GGML_QUANT_SIZES[main]
    return 8 * size / block


def n_ctx(shape: Shape | None, settings: EngineSettings) -> int:
    return settings.n_ctx(shape.n_ctx_train if shape is not None else None)


def estimate_bytes(spec: ModelSpec, settings: EngineSettings, backend: str) -> int:
    """Weights (file sizes, scaled to the load-time quantization if any) plus the KV cache the settings ask
    for. An estimate: llama.cpp's compute buffers and the tokenizer are left out."""
    weights = sum(Path(f).stat().st_size for f in spec.files)
    bits = _target_bits(settings.quant)
    source = _SOURCE_BITS.get(str(spec.quant.get("dtype", "")))
    if bits is not None and source is not None:
        weights = int(weights * bits / source)
    shape = model_shape(spec)
    if shape is None:
        return weights
    ctx = n_ctx(shape, settings)
    if backend == "llamacpp" and settings.llamacpp.kv_unified:
        cells = max(settings.kv_size or 2 * ctx, ctx)
    else:
        cells = settings.kv_size or ctx * settings.max_num_seqs
    if backend == "llamacpp":
        k, v = settings.llamacpp.cache_type_k, settings.llamacpp.cache_type_v
        per_elem = (_KV_BYTES.get(k.lower(), 2) + _KV_BYTES.get(v.lower(), 2)) / 2
    else:
        per_elem = 2.0
    return weights + int(2 * shape.kv_heads * shape.head_dim * cells * per_elem)


def free_bytes(backend: str) -> int | None:
    """Memory a new model can use now: the GPU's free memory for the torch backend on CUDA, else the OS's
    available memory (Linux's MemAvailable: free plus reclaimable page cache). None where it cannot be told."""
    if backend == "torch":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.mem_get_info()[0]
        except ImportError:
            pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def parse_size(text: str) -> int:
    """'24G', '512M', '1.5GiB', '1000000': bytes (K/M/G/T are powers of 1024).

    Raises:
        ValueError: not a size.
    """
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if t and t[-1] in "KMGT":
        scale, t = 2 ** (10 * ("KMGT".index(t[-1]) + 1)), t[:-1]
    value = float(t)
    if not value > 0:
        raise ValueError(text)
    return int(value * scale)
