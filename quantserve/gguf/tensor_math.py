"""Pure numpy helpers for conversion: the llama q/k row permutation and float-format bit conversions."""

from __future__ import annotations

import numpy as np


def qk_gguf_rows_for_hf(n_rows: int, n_head: int) -> np.ndarray:
    """Row gather index that undoes llama.cpp's q/k permutation: `hf = gguf[idx]`.

    See docs/gguf.md, "Q/K permutation".

    HF row h·D + r comes from GGUF row h·D + 2·(r mod D/2) + r // (D/2), D = n_rows // n_head.
    It moves whole rows, so it applies equally to float rows and to quantized row bytes.
    """
    d = n_rows // n_head
    if d * n_head != n_rows or d % 2:
        raise ValueError(f"{n_rows} rows do not split into {n_head} heads of even size")
    return np.arange(n_rows).reshape(n_head, d // 2, 2).swapaxes(1, 2).reshape(-1)


def qk_hf_rows_for_gguf(n_rows: int, n_head: int) -> np.ndarray:
    """The inverse gather, llama.cpp's `LlamaModel.permute`: `gguf = hf[idx]`.

    GGUF row h·D + 2j + half comes from HF row h·D + half·(D/2) + j.
    """
    d = n_rows // n_head
    if d * n_head != n_rows or d % 2:
        raise ValueError(f"{n_rows} rows do not split into {n_head} heads of even size")
    return np.arange(n_rows).reshape(n_head, 2, d // 2).swapaxes(1, 2).reshape(-1)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 (or 2 raw bytes per value) -> float32; exact, no torch needed."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even like torch and ggml; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)  # quiet NaN, sign kept
    return rounded
