"""What a model will take before it is loaded (weights plus KV cache), and what memory is free: the router's
basis for unloading models to make room (--memory-budget)."""

from __future__ import annotations

import os
from pathlib import Path

from quantserve.core.model_size import kv_bytes, model_shape
from quantserve.core.settings import EngineSettings
from quantserve.formats import ModelSpec

_SOURCE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "float32": 32, "float16": 16, "bfloat16": 16}


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
    return weights + kv_bytes(shape, settings, backend)


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
