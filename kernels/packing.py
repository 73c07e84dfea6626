"""Bit packing of small unsigned integers into int32 words: LSB-first, little-endian, along either axis.

For bits in {1, 2, 4, 8}, value p of a word sits at bits [b·p, b·p + b) (GPTQ, AWQ before its interleave,
compressed-tensors). Other widths (3-bit GPTQ, compressed-tensors ≥ 0.18) use the dense bitstream: value j of a
row starts at global bit b·j and may straddle two words. For {1, 2, 4, 8} both rules give the same bits.
"""

from __future__ import annotations

import torch

from .qweight import QuantLayoutError


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 values -> int32 with the same bits (safetensors stores packed words as I32)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _to_uint(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> int64 in [0, 2^32): shifting a negative int32 right would smear the sign bit."""
    return words.to(torch.int64) & 0xFFFFFFFF


def packed_len(count: int, bits: int) -> int:
    """Words needed for `count` values of `bits` bits."""
    return -(-count * bits // 32)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack uint8 values [.., E, ..] along `dim` into int32 words [.., ceil(E·bits/32), ..]; padding is zeros."""
    if values.dim() != 2 or dim not in (0, 1):
        raise QuantLayoutError(
            f"pack expects a 2-D tensor and dim 0 or 1; got {tuple(values.shape)}, dim {dim}"
        )
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    rows, count = v.shape
    n_words = packed_len(count, bits)
    if 32 % bits == 0:
        pf = 32 // bits
        v = torch.nn.functional.pad(v, (0, n_words * pf - count)).reshape(rows, n_words, pf)
        shifts = torch.arange(pf, device=v.device, dtype=torch.int64) * bits
        words = (v << shifts).sum(-1)
    else:
        # Dense bitstream: spell every value out as bits, regroup the bits 32 at a time.
        place = torch.arange(bits, device=v.device, dtype=torch.int64)
        stream = ((v.unsqueeze(-1) >> place) & 1).reshape(rows, count * bits)
        stream = torch.nn.functional.pad(stream, (0, n_words * 32 - count * bits)).reshape(rows, n_words, 32)
        words = (stream << torch.arange(32, device=v.device, dtype=torch.int64)).sum(-1)
    words = _to_int32(words)
    return words.t().contiguous() if dim == 0 else words.contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int, count: int | None = None) -> torch.Tensor:
    """Inverse of `pack`: int32 words -> uint8 values along `dim`, `count` of them (default: all slots)."""
    if words.dim() != 2 or dim not in (0, 1):
        raise QuantLayoutError(
            f"unpack expects a 2-D tensor and dim 0 or 1; got {tuple(words.shape)}, dim {dim}"
        )
    w = _to_uint(words)
    if dim == 0:
        w = w.t()
    rows, n_words = w.shape
    full = n_words * 32 // bits
    count = full if count is None else count
    if count > full:
        raise QuantLayoutError(f"{n_words} words of {bits}-bit values hold {full} values, not {count}")
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        shifts = torch.arange(32 // bits, device=w.device, dtype=torch.int64) * bits
        v = ((w.unsqueeze(-1) >> shifts) & mask).reshape(rows, full)
    else:
        stream = ((w.unsqueeze(-1) >> torch.arange(32, device=w.device, dtype=torch.int64)) & 1).reshape(
            rows, -1
        )
        stream = stream[:, : full * bits].reshape(rows, full, bits)
        v = (stream << torch.arange(bits, device=w.device, dtype=torch.int64)).sum(-1)
    v = v[:, :count].to(torch.uint8)
    return v.t().contiguous() if dim == 0 else v.contiguous()
