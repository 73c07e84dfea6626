"""GGUF -> HF checkpoint: dequantize every tensor, undo llama.cpp's q/k permutation, rebuild config and tokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from quantserve.converters.gguf.config import TORCH_DTYPES, generation_config, hf_config, model_card
from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf
from quantserve.errors import ConfigError, UnsupportedFormatError
from quantserve.formats import read_gguf_info
from quantserve.formats.safetensors_out import PlannedTensor, SafetensorsWriter
from quantserve.formats.spec import GGUFInfo, GGUFTensorInfo
from quantserve.formats.staging import check_destination, ensure_free_space, staged_output
from quantserve.gguf.archs import ArchSpec, arch_for_gguf
from quantserve.gguf.tensor_math import f32_to_bf16, qk_gguf_rows_for_hf
from quantserve.gguf.tensors import GGUFTensorReader

log = logging.getLogger(__name__)
_ST_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
# rope factors llama.cpp keeps as tensors (llama3's, LongRoPE's): folded into config.json's rope_scaling instead
_SKIP = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _encode(chunk: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return f32_to_bf16(chunk)
    return chunk.astype(np.float16 if dtype == "fp16" else np.float32, copy=False)


def _plan(
    info: GGUFInfo, spec: ArchSpec, dtype: str
) -> list[tuple[GGUFTensorInfo, PlannedTensor, int | None]]:
    """Each HF tensor with the GGUF tensor it comes from, and for an expert its index in that stacked tensor."""
    plan: list[tuple[GGUFTensorInfo, PlannedTensor, int | None]] = []
    for t in info.tensors:
        if t.name in _SKIP:
            continue
        if spec.hf_expert_name(t.name, 0) is not None:  # every expert of a layer, stacked: one HF tensor each
            shape = tuple(reversed(t.shape[:-1]))
            for e in range(t.shape[-1]):
                name = spec.hf_expert_name(t.name, e)
                plan.append((t, PlannedTensor(name, _ST_DTYPES[dtype], shape), e))  # type: ignore[arg-type]
            continue
        name = spec.hf_name(t.name)
        if name is None:
            raise UnsupportedFormatError(
                f"{info.path.name}: tensor '{t.name}' has no HF {spec.hf_architecture} equivalent; this GGUF "
                "variant of the architecture is not supported"
            )
        plan.append((t, PlannedTensor(name, _ST_DTYPES[dtype], tuple(reversed(t.shape))), None))
    return plan


def _row_order(t: GGUFTensorInfo, spec: ArchSpec, info: GGUFInfo) -> np.ndarray | None:
    """The gather index that undoes llama.cpp's permutation for q/k weights and biases, else None."""
    if not spec.permute_qk:
        return None
    md, arch = info.metadata, spec.gguf_arch
    n_head = md[f"{arch}.attention.head_count"]
    if t.name.endswith((".attn_q.weight", ".attn_q.bias")):
        return qk_gguf_rows_for_hf(t.shape[-1], n_head)
    if t.name.endswith((".attn_k.weight", ".attn_k.bias")):
        return qk_gguf_rows_for_hf(t.shape[-1], md.get(f"{arch}.attention.head_count_kv", n_head))
    return None


def _tensor_chunks(
    reader: GGUFTensorReader, t: GGUFTensorInfo, spec: ArchSpec, dtype: str, expert: int | None
) -> Iterator[np.ndarray]:
    rows = _row_order(t, spec, reader.info)
    if expert is not None:  # one expert's rows of the stacked tensor
        rows = np.arange(expert * t.shape[1], (expert + 1) * t.shape[1])
    # Gemma's (1 + w) norms are stored with the 1 added (ArchSpec.norm_shift)
    shift = np.float32(spec.norm_shift if t.name.endswith("norm.weight") else 0.0)
    for chunk in reader.chunks(t, rows):
        yield _encode(chunk - shift if shift else chunk, dtype)


def gguf_to_hf(src: Path, dst: Path, dtype: str = "bf16", progress: bool = True, force: bool = False) -> Path:
    """Convert a GGUF file into an HF checkpoint directory that transformers loads.

    Args:
        src: a .gguf file (llama, mistral and mixtral as llama, qwen2, qwen3, qwen3moe or phi3; not split).
        dst: the directory to create.
        dtype: "bf16", "fp16" or "fp32" for the safetensors weights.
        progress: show a tqdm bar per tensor.
        force: replace an existing dst.
    Returns:
        dst.
    Raises:
        ConfigError: bad dtype, or dst exists without force.
        ModelFileError / UnsupportedFormatError: the GGUF is malformed or of an unsupported kind.
        ConversionError: the disk filled up (nothing is left behind).
    """
    src, dst = Path(src), Path(dst)
    if dtype not in _ST_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(_ST_DTYPES)}")
    info = read_gguf_info(src)
    if info.split_count > 1:
        raise UnsupportedFormatError(
            f"{src.name} is part of a {info.split_count}-part split GGUF; merge it first with "
            "`llama-gguf-split --merge FIRST_PART merged.gguf`"
        )
    spec = arch_for_gguf(info.architecture, frozenset(t.name for t in info.tensors))
    if not spec.to_hf:
        raise UnsupportedFormatError(
            f"{src.name} is {spec.gguf_arch}, which quantserve does not convert from GGUF to HF (its tensors were "
            "reshaped or repacked one way); use the original HF checkpoint"
        )
    check_destination(dst, force)
    reader = GGUFTensorReader(info)
    small = {t.name: t for t in info.tensors if t.name in _SKIP}
    rope_freqs = reader.read(small["rope_freqs.weight"]) if "rope_freqs.weight" in small else None
    factors = None
    if "rope_factors_long.weight" in small and "rope_factors_short.weight" in small:
        factors = (
            reader.read(small["rope_factors_long.weight"]),
            reader.read(small["rope_factors_short.weight"]),
        )
    config = hf_config(info, spec, dtype, rope_freqs, factors)
    tokenizer = tokenizer_from_gguf(info.metadata, model_max_length=config["max_position_embeddings"])
    plan = _plan(info, spec, dtype)
    ensure_free_space(dst.parent, sum(p.n_bytes for _, p, _ in plan), f"converting {src.name}")
    log.info(
        "converting %s (%s, %s) to %s at %s",
        src.name,
        info.architecture,
        info.file_type,
        TORCH_DTYPES[dtype],
        dst,
    )
    with staged_output(dst, directory=True, force=force) as tmp:
        with SafetensorsWriter(tmp, [p for _, p, _ in plan]) as writer:
            for t, planned, expert in tqdm(plan, desc="dequantize", unit="tensor", disable=not progress):
                writer.write(planned.name, _tensor_chunks(reader, t, spec, dtype, expert))
        for name, obj in (
            ("config.json", config),
            ("generation_config.json", generation_config(info.metadata, config)),
        ):
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        tokenizer.save(tmp)
        (tmp / "README.md").write_text(model_card(info.metadata, src.name), encoding="utf-8")
    return dst
