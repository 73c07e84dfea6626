"""summarize(path) and render_summary(): what `quantserve inspect` shows about a model's files, from headers only.
What quantserve decides to do with them (backend, template, capabilities) is the ModelPlan's (core/plan.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantserve.formats.detect import detect
from quantserve.formats.gguf import read_gguf_info
from quantserve.formats.hf_config import layer_windows
from quantserve.formats.safetensors_header import DTYPE_BITS, read_safetensors_header
from quantserve.formats.spec import ModelSpec


@dataclass(frozen=True, eq=False)
class ModelSummary:
    path: Path
    format: str
    architecture: str | None
    n_params: int  # logical weights: a packed int4 word counts as 8 parameters
    n_tensors: int
    quant_types: dict[str, str]  # tensor class ("attn_q", "q_proj", "token_embd") -> type(s) stored
    bits_per_weight: float  # tensor bytes * 8 / n_params, scales and zeros included
    file_size: int  # all weight files together
    files: tuple[Path, ...]
    context_length: int | None  # the context it was trained for
    quant: dict[str, Any]  # spec.quant
    experts: str | None = None  # a mixture of experts' routing, in words (None: a dense model)
    windows: str | None = None  # which layers attend within a window, in words (None: none do)


def _types_by_class(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """'Q4_K' or 'Q4_K×20, Q6_K×4' per class when layers differ (llama.cpp's _M mixes do)."""
    counts: dict[str, dict[str, int]] = {}
    for cls, typ in pairs:
        counts.setdefault(cls, {}).setdefault(typ, 0)
        counts[cls][typ] += 1
    out = {}
    for cls, by_type in counts.items():
        ranked = sorted(by_type.items(), key=lambda kv: -kv[1])
        out[cls] = ranked[0][0] if len(ranked) == 1 else ", ".join(f"{t}×{n}" for t, n in ranked)
    return out


def _gguf_class(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        parts = parts[2:]
    return ".".join(parts[:-1] if parts[-1] == "weight" and len(parts) > 1 else parts)


def _summarize_gguf(spec: ModelSpec) -> dict[str, Any]:
    infos = [read_gguf_info(f) for f in spec.files]
    tensors = [t for info in infos for t in info.tensors]
    return {
        "n_params": sum(t.n_elements for t in tensors),
        "n_tensors": len(tensors),
        "n_bytes": sum(t.n_bytes for t in tensors),
        "quant_types": _types_by_class((_gguf_class(t.name), t.type_name) for t in tensors),
        "context_length": infos[0].context_length,
        "experts": _gguf_experts(infos[0].metadata, infos[0].architecture),
        "windows": _gguf_windows(infos[0].metadata, infos[0].architecture),
    }


def _gguf_experts(md: dict[str, Any], arch: str | None) -> tuple[int, int, int, int, int] | None:
    keys = (
        "expert_count",
        "expert_used_count",
        "embedding_length",
        "expert_feed_forward_length",
        "block_count",
    )
    values = [md.get(f"{arch}.{k}") for k in keys]
    if values[3] is None:  # Mixtral's experts are its feed_forward_length wide
        values[3] = md.get(f"{arch}.feed_forward_length")
    return tuple(values) if all(isinstance(v, int) for v in values) else None  # type: ignore[return-value]


def _hf_experts(config: dict[str, Any]) -> tuple[int, int, int, int, int] | None:
    n = config.get("num_local_experts") or config.get("num_experts")
    ff = config.get("moe_intermediate_size") or config.get("intermediate_size")
    values = [
        n,
        config.get("num_experts_per_tok"),
        config.get("hidden_size"),
        ff,
        config.get("num_hidden_layers"),
    ]
    return tuple(values) if all(isinstance(v, int) for v in values) else None  # type: ignore[return-value]


def _experts_line(facts: tuple[int, int, int, int, int] | None, n_params: int) -> str | None:
    """'4 experts, 2 routed per token: 15.7M of 26.2M parameters active' (a gated MLP is 3 matrices)."""
    if facts is None:
        return None
    n, used, hidden, ff, layers = facts
    active = n_params - layers * (n - used) * 3 * hidden * ff
    step = ("", "K", "M", "B", "T")
    return (
        f"{n} experts, {used} routed per token: {_count(active, step, 1000)} of {_count(n_params, step, 1000)} "
        "parameters active"
    )


# Tensors that hold a quantized linear's packed weights, and those that only describe them.
_PACKED = {"qweight", "B", "weight_packed"}
_AUXILIARY = {
    "qzeros",
    "scales",
    "g_idx",
    "s",
    "weight_scale",
    "weight_zero_point",
    "weight_g_idx",
    "weight_shape",
    "weight_scale_inv",  # FP8's scales (its weights count as F8_E4M3 parameters)
    "input_scale",
    "input_zero_point",
}


def _quant_label(spec: ModelSpec, bits: int, group: int) -> str:
    assert spec.scheme is not None
    if spec.scheme.float_weights:
        return spec.scheme.label
    return f"{spec.scheme.label} int{bits} {'per-channel' if group == -1 else f'g{group}'}"


def _summarize_hf(spec: ModelSpec) -> dict[str, Any]:
    headers = [read_safetensors_header(f) for f in spec.files]
    tensors = [t for h in headers for t in h.tensors.values()]
    quantized = {
        t.name.rsplit(".", 1)[0]
        for t in tensors
        if t.name.rsplit(".", 1)[-1] in _PACKED
        or (t.name.endswith(".weight") and (t.dtype.startswith("F8") or (t.dtype == "I8" and spec.scheme)))
    }
    n_params, classes = 0, []
    for t in tensors:
        prefix, _, last = t.name.rpartition(".")
        cls = prefix.rsplit(".", 1)[-1] if prefix else t.name
        if prefix in quantized and last in _PACKED and spec.scheme:
            # per module: GPTQModel `dynamic` rules may give a linear other bits than the config's
            bits, group = spec.scheme.layer(prefix).bits, spec.scheme.layer(prefix).group_size
            n_params += t.n_elements * DTYPE_BITS[t.dtype] // bits  # each word packs dtype_bits/bits weights
            classes.append((cls, _quant_label(spec, bits, group)))
        elif prefix in quantized and last in _AUXILIARY:
            continue
        elif spec.quant.get("experts") == "mxfp4" and last.endswith(
            ("_blocks", "_scales")
        ):  # gpt-oss as released
            if last.endswith("_blocks"):  # two weights a byte (the scales are not weights)
                n_params += 2 * t.n_elements
                classes.append((last.removesuffix("_blocks"), "MXFP4"))
        else:
            n_params += t.n_elements
            if last == "weight":
                classes.append((cls, t.dtype))
    config = spec.config or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    ctx = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key, text.get(key))
        if isinstance(value, int) and not isinstance(value, bool):
            ctx = value
            break
    return {
        "n_params": n_params,
        "n_tensors": len(tensors),
        "n_bytes": sum(t.n_bytes for t in tensors),
        "quant_types": _types_by_class(classes),
        "context_length": ctx,
        "experts": _hf_experts({**config, **text}),
        "windows": _hf_windows(config),
    }


def summarize(path: str | os.PathLike[str] | ModelSpec) -> ModelSummary:
    """Summarize a model's files (a path or an already detected spec) from their headers; tensor data is never
    read.

    Raises: whatever detect() raises for the path.
    """
    spec = path if isinstance(path, ModelSpec) else detect(path)
    facts = _summarize_gguf(spec) if spec.format == "gguf" else _summarize_hf(spec)
    n_params = facts["n_params"]
    return ModelSummary(
        path=spec.path,
        format=spec.format,
        architecture=spec.architecture,
        n_params=n_params,
        n_tensors=facts["n_tensors"],
        quant_types=facts["quant_types"],
        bits_per_weight=facts["n_bytes"] * 8 / n_params if n_params else 0.0,
        file_size=sum(f.stat().st_size for f in spec.files),
        files=spec.files,
        context_length=facts["context_length"],
        quant=dict(spec.quant),
        experts=_experts_line(facts["experts"], n_params),
        windows=facts["windows"],
    )


def _hf_windows(config: dict[str, Any]) -> str | None:
    """'3 of 4 layers within 4096 tokens, 1 global', 'every layer within 2047 tokens' (hf_config.layer_windows,
    which the torch backend's model reads too); None for a model without windows."""
    try:
        windows = layer_windows(config)
    except ValueError:
        return None
    sizes = sorted({w for w in windows if w})
    if not sizes:
        return None
    local = sum(1 for w in windows if w)
    within = "/".join(map(str, sizes))
    ctx = config.get("max_position_embeddings")
    if isinstance(ctx, int) and sizes[0] >= ctx:
        return f"a window of {within} tokens, not shorter than the {ctx}-token context: none applies"
    if local == len(windows):
        return f"every layer within {within} tokens"
    return f"{local} of {len(windows)} layers within {within} tokens, {len(windows) - local} global"


def _gguf_windows(md: dict[str, Any], arch: str | None) -> str | None:
    window = md.get(f"{arch}.attention.sliding_window")
    return f"windowed layers within {window} tokens" if isinstance(window, int) and window else None


def _count(n: float, units: tuple[str, ...], step: int) -> str:
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.1f}{unit}" if unit != units[0] else f"{int(n)}{unit}"
        n /= step
    raise AssertionError("unreachable")


def render_summary(s: ModelSummary, extra: tuple[tuple[str, list[str]], ...] = ()) -> str:
    """An aligned 'key: value' table; multi-valued keys continue on indented lines. `extra`: rows the caller
    adds after the summary's own (`inspect` adds the model's plan)."""
    rows: list[tuple[str, list[str]]] = [
        ("path", [str(s.path)]),
        ("format", [s.format]),
        ("architecture", [s.architecture or "unknown"]),
        ("parameters", [f"{_count(s.n_params, ('', 'K', 'M', 'B', 'T'), 1000)} ({s.n_params:,})"]),
        (
            "file size",
            [f"{_count(s.file_size, (' B', ' KB', ' MB', ' GB', ' TB'), 1000)} in {len(s.files)} file(s)"],
        ),
        ("bits per weight", [f"{s.bits_per_weight:.2f}"]),
        ("trained context", [str(s.context_length) if s.context_length else "unknown"]),
        ("quantization", [", ".join(f"{k}={v}" for k, v in s.quant.items())]),
        ("tensor types", [f"{cls}: {typ}" for cls, typ in sorted(s.quant_types.items())] or ["none"]),
        *([("experts", [s.experts])] if s.experts else []),
        *([("attention windows", [s.windows])] if s.windows else []),
        *extra,
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = []
    for key, values in rows:
        lines.append(f"{key + ':':<{width}}{values[0]}")
        lines.extend(" " * width + v for v in values[1:])
    return "\n".join(lines)
