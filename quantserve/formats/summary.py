"""summarize(path) and render_summary(): what `quantserve inspect` shows about a model, from headers only."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError
from quantserve.formats.detect import detect
from quantserve.formats.gguf import read_gguf_info
from quantserve.formats.hf_config import is_llava, read_json_object
from quantserve.formats.mmproj import describe_mmproj, find_mmproj, is_mmproj
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
    context_length: int | None
    has_chat_template: bool
    backends: tuple[str, ...]  # "llamacpp", "torch", "llamacpp (after convert)"
    backend_notes: tuple[str, ...]  # why each backend applies, same order
    quant: dict[str, Any]  # spec.quant
    vision: str | None = None  # a LLaVA's vision side, or what a projector file is
    mmproj: Path | None = None  # the vision projector served with a GGUF model
    rank_outputs: int = 0  # a reranker GGUF's classification head (GGUFInfo.rank_outputs)


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
        "has_chat_template": infos[0].chat_template is not None,
        "rank_outputs": infos[0].rank_outputs,
    }


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
}


def _quant_label(spec: ModelSpec, bits: int, group: int) -> str:
    assert spec.scheme is not None
    return f"{spec.scheme.label} int{bits} {'per-channel' if group == -1 else f'g{group}'}"


def _summarize_hf(spec: ModelSpec) -> dict[str, Any]:
    headers = [read_safetensors_header(f) for f in spec.files]
    tensors = [t for h in headers for t in h.tensors.values()]
    quantized = {t.name.rsplit(".", 1)[0] for t in tensors if t.name.rsplit(".", 1)[-1] in _PACKED}
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
        "has_chat_template": _hf_has_chat_template(spec.directory),
    }


def _hf_has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    tok = directory / "tokenizer_config.json"
    return bool(tok.is_file() and read_json_object(tok).get("chat_template"))


def _llava_vision(config: dict[str, Any]) -> str:
    v = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return (
        f"LLaVA: {v.get('model_type', 'clip_vision_model')} tower ({v.get('num_hidden_layers', '?')} blocks, "
        f"{v.get('image_size', '?')} px images in {v.get('patch_size', '?')} px patches, features of layer "
        f"{config.get('vision_feature_layer', -2)}), {config.get('projector_hidden_act', 'gelu')} MLP projector, "
        f"{text.get('model_type', 'llama')} language model"
    )


def _vision(spec: ModelSpec, mmproj: Path | None) -> tuple[str | None, Path | None, bool]:
    """What the model sees images with: a LLaVA's own tower, or the projector served with a GGUF; and whether
    the file is itself a projector. Returns (description, projector file, is a projector)."""
    if spec.format == "gguf":
        info = read_gguf_info(spec.files[0])
        if is_mmproj(info):
            return f"vision projector (mmproj): {describe_mmproj(info)}", None, True
        if mmproj is None:
            try:
                mmproj = find_mmproj(spec.path)
            except ModelFileError as exc:
                return f"unknown: {exc.message}", None, False
        if mmproj is None:
            return None, None, False
        projector = read_gguf_info(mmproj)
        if not is_mmproj(projector):
            raise ModelFileError(
                f"{mmproj}: not a vision projector (general.architecture {projector.get('general.architecture')!r}"
                "); point models.toml's mmproj at the mmproj-*.gguf that `quantserve convert` wrote"
            )
        return f"images through {mmproj.name}: {describe_mmproj(projector)}", mmproj, False
    return (_llava_vision(spec.config or {}) if is_llava(spec.config) else None), None, False


def _backends(
    spec: ModelSpec, vision: str | None, mmproj: Path | None, projector: bool
) -> list[tuple[str, str]]:
    """Which backends can serve the model, and why."""
    if spec.format == "gguf":
        if projector:
            return [("llamacpp", "a vision projector for libmtmd, not a model: serve its LLaVA text GGUF with it "
                     "(beside it, or as `mmproj` in models.toml)")]  # fmt: skip
        images = f"; images through {mmproj.name} (libmtmd)" if mmproj else ""
        return [("llamacpp", f"GGUF is llama.cpp's native format ({spec.quant['file_type']}){images}")]
    if spec.scheme is not None:
        return [("torch", f"{spec.scheme.summary()} linear layers")]
    if vision:  # a LLaVA checkpoint
        return [
            ("torch", f"dense {spec.quant['dtype']} weights, images through the CLIP tower"),
            ("llamacpp (after convert)", "`quantserve convert --src DIR --dst OUT/ --quant TYPE` writes the text "
             "GGUF and its vision projector (mmproj) for libmtmd"),
        ]  # fmt: skip
    return [
        ("torch", f"dense {spec.quant['dtype']} weights"),
        ("llamacpp (after convert)", "convert to GGUF (optionally quantizing) first"),
    ]


def summarize(path: str | os.PathLike[str] | ModelSpec, mmproj: Path | None = None) -> ModelSummary:
    """Summarize a model (path or an already detected spec) from its headers; tensor data is never read.

    Args:
        mmproj: a GGUF model's vision projector (models.toml's `mmproj`); by default one beside it is found.
    Raises: whatever detect() raises for the path; ModelFileError when `mmproj` is not a projector.
    """
    spec = path if isinstance(path, ModelSpec) else detect(path)
    facts = _summarize_gguf(spec) if spec.format == "gguf" else _summarize_hf(spec)
    vision, mmproj, projector = _vision(spec, mmproj)
    backends = _backends(spec, vision, mmproj, projector)
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
        has_chat_template=facts["has_chat_template"],
        backends=tuple(name for name, _ in backends),
        backend_notes=tuple(note for _, note in backends),
        quant=dict(spec.quant),
        vision=vision,
        mmproj=mmproj,
        rank_outputs=facts.get("rank_outputs", 0),
    )


def _count(n: float, units: tuple[str, ...], step: int) -> str:
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.1f}{unit}" if unit != units[0] else f"{int(n)}{unit}"
        n /= step
    raise AssertionError("unreachable")


def _rerank_row(s: ModelSummary) -> str:
    if s.rank_outputs > 2:
        return f"no: a classification head of {s.rank_outputs} classes, not a relevance score"
    if s.rank_outputs:
        return f"cross-encoder: a classification head of {s.rank_outputs} output(s), llama.cpp rank pooling (/v1/rerank)"
    return "yes/no judge with its chat template (/v1/rerank)" if s.has_chat_template else "no"


def render_summary(s: ModelSummary, extra: tuple[tuple[str, list[str]], ...] = ()) -> str:
    """An aligned 'key: value' table; multi-valued keys continue on indented lines. `extra`: rows the caller
    adds after the summary's own (the CLI's GPU offload line)."""
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
        ("context length", [str(s.context_length) if s.context_length else "unknown"]),
        ("chat template", ["yes" if s.has_chat_template else "no"]),
        ("rerank", [_rerank_row(s)]),
        ("quantization", [", ".join(f"{k}={v}" for k, v in s.quant.items())]),
        ("tensor types", [f"{cls}: {typ}" for cls, typ in sorted(s.quant_types.items())] or ["none"]),
        *([("vision", [s.vision])] if s.vision else []),
        ("backends", [f"{b} — {note}" for b, note in zip(s.backends, s.backend_notes, strict=True)]),
        *extra,
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = []
    for key, values in rows:
        lines.append(f"{key + ':':<{width}}{values[0]}")
        lines.extend(" " * width + v for v in values[1:])
    return "\n".join(lines)
