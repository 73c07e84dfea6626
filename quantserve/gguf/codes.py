"""The integer codes inside GGUF quant blocks, apart from their scales: read them, and write new ones in place.

Every type here dequantizes as `value = scale · code + offset`, where scale and offset come from the block's
header bytes (d, dmin, the 6-bit K-quant sub-scales, ...) and the code is a small integer. Calibrated GGUF
rounding (converters/calibration/gguf_gptq.py) keeps the headers llama.cpp chose and picks new codes: `grid`
gives every weight's scale and offset, `write_codes` stores codes without touching a header byte.

Layouts (ggml-common.h, block_q4_0 ... block_q6_K; gguf-py's quants.py decodes them the same way), per block:
- Q4_0/Q4_1: header (d | d, m), then 16 bytes: code j in byte j's low nibble, code j+16 in its high nibble.
- Q5_0/Q5_1: header, a little-endian u32 whose bit j is code j's 5th bit, then the Q4 nibbles.
- Q8_0: d, then 32 int8 codes.
- Q4_K: d, dmin, 12 scale bytes, then 4 x 32 bytes: chunk c's low nibbles are codes 64c..64c+31, its high
  nibbles codes 64c+32..64c+63.
- Q5_K: like Q4_K with 32 high-bit bytes before the nibbles: bit s of byte l is code 32s+l's 5th bit.
- Q6_K: 128 nibble bytes, 64 high-bit bytes, then 16 int8 scales and d. Code 128h+32s+l: nibble byte
  64h + 32(s%2) + l (low nibble for s < 2, high for s >= 2), high bits 2s..2s+1 of byte 32h + l.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

T = GGMLQuantizationType


@dataclass(frozen=True)
class _Layout:
    nibbles: int  # first byte of the packed low nibbles
    nibble_run: int  # codes per nibble run: a byte holds code j and code j + nibble_run
    high: int | None  # first byte of the high bits, if any
    lo: int  # the code range, as dequantization reads it
    hi: int


_LAYOUTS = {
    T.Q4_0: _Layout(2, 16, None, 0, 15),
    T.Q4_1: _Layout(4, 16, None, 0, 15),
    T.Q5_0: _Layout(6, 16, 2, 0, 31),
    T.Q5_1: _Layout(8, 16, 4, 0, 31),
    T.Q8_0: _Layout(2, 0, None, -127, 127),  # int8 codes; llama.cpp's own range (symmetric)
    T.Q4_K: _Layout(16, 32, None, 0, 15),
    T.Q5_K: _Layout(48, 32, 16, 0, 31),
    T.Q6_K: _Layout(0, 64, 128, 0, 63),
}
SUPPORTED = frozenset(_LAYOUTS)


def code_range(qtype: T) -> tuple[int, int]:
    """(lowest, highest) code of a type."""
    lay = _LAYOUTS[qtype]
    return lay.lo, lay.hi


def _blocks(raw: np.ndarray, qtype: T) -> np.ndarray:
    size = GGML_QUANT_SIZES[qtype][1]
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)


def read_codes(raw: np.ndarray, qtype: T) -> np.ndarray:
    """int16 codes [rows, n_per_row] of quantized rows `raw` [rows, row_bytes]."""
    lay, b = _LAYOUTS[qtype], _blocks(raw, qtype)
    n, per = b.shape[0], GGML_QUANT_SIZES[qtype][0]
    if qtype == T.Q8_0:
        return b[:, 2:34].view(np.int8).astype(np.int16).reshape(raw.shape[0], -1)
    nb = per // 2  # nibble bytes per block
    by = b[:, lay.nibbles : lay.nibbles + nb].reshape(n, -1, 1, lay.nibble_run)
    codes = (by >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    codes = codes.reshape(n, per).astype(np.int16)
    if qtype in (T.Q5_0, T.Q5_1):
        bits = np.unpackbits(b[:, lay.high : lay.high + 4], axis=-1, bitorder="little")
        codes |= bits.astype(np.int16) << 4
    elif qtype == T.Q5_K:
        bits = np.unpackbits(b[:, lay.high : lay.high + 32], axis=-1, bitorder="little")  # [n, l * 8 + s]
        codes |= bits.reshape(n, 32, 8).transpose(0, 2, 1).reshape(n, per).astype(np.int16) << 4
    elif qtype == T.Q6_K:
        qh = b[:, lay.high : lay.high + 64].reshape(n, 2, 1, 32)
        two = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        codes |= two.reshape(n, per).astype(np.int16) << 4
    return codes.reshape(raw.shape[0], -1)


def write_codes(raw: np.ndarray, qtype: T, codes: np.ndarray) -> np.ndarray:
    """A copy of quantized rows `raw` [rows, row_bytes] holding `codes` [rows, n_per_row], headers unchanged.

    Raises:
        ValueError: a code outside the type's range (code_range).
    """
    lay, b = _LAYOUTS[qtype], _blocks(raw, qtype).copy()
    n, per = b.shape[0], GGML_QUANT_SIZES[qtype][0]
    if codes.min() < lay.lo or codes.max() > lay.hi:
        raise ValueError(f"{qtype.name} codes must lie in [{lay.lo}, {lay.hi}]")
    c = np.asarray(codes).reshape(n, per)
    if qtype == T.Q8_0:
        b[:, 2:34] = c.astype(np.int8).view(np.uint8)
        return b.reshape(raw.shape)
    u = c.astype(np.uint8)
    pairs = u.reshape(n, -1, 2, lay.nibble_run) & 15
    b[:, lay.nibbles : lay.nibbles + per // 2] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1)
    if qtype in (T.Q5_0, T.Q5_1):
        b[:, lay.high : lay.high + 4] = np.packbits((u >> 4) & 1, axis=-1, bitorder="little")
    elif qtype == T.Q5_K:
        bits = ((u >> 4) & 1).reshape(n, 8, 32).transpose(0, 2, 1)  # [n, l, s]
        b[:, lay.high : lay.high + 32] = np.packbits(bits, axis=-1, bitorder="little").reshape(n, 32)
    elif qtype == T.Q6_K:
        two = ((u >> 4) & 3).reshape(n, 2, 4, 32)
        qh = two[:, :, 0] | (two[:, :, 1] << 2) | (two[:, :, 2] << 4) | (two[:, :, 3] << 6)
        b[:, lay.high : lay.high + 64] = qh.reshape(n, 64)
    return b.reshape(raw.shape)


def grid(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """float32 (scale, offset), each [rows, n_per_row]: weight i of `raw` dequantizes as scale·code + offset.

    Read through gguf-py's own dequantization of the block with every code set to 0 and to 1.
    """
    rows = raw.shape[0]
    lo = np.zeros((rows, raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0]), np.int16)
    offset = quants.dequantize(write_codes(raw, qtype, lo), qtype).reshape(rows, -1)
    one = quants.dequantize(write_codes(raw, qtype, lo + 1), qtype).reshape(rows, -1)
    return (one - offset).astype(np.float32), offset.astype(np.float32)
