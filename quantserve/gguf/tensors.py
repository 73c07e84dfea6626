"""Read GGUF tensor data through a memory map and dequantize it to float32 in row chunks."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from quantserve.formats.spec import GGUFInfo, GGUFTensorInfo

CHUNK_BYTES = 64 * 2**20  # float32 bytes per yielded chunk: bounds peak memory for embedding-sized tensors


class GGUFTensorReader:
    """Row views of one GGUF file's tensors; nothing is read until a chunk is dequantized."""

    def __init__(self, info: GGUFInfo):
        self.info = info
        self._mm = np.memmap(info.path, dtype=np.uint8, mode="r")

    def raw_rows(self, t: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as [rows, bytes_per_row] (rows = product of ne[1:]; a 1-D tensor is one row)."""
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        row_bytes = t.shape[0] // block * type_size
        data = self._mm[t.offset : t.offset + t.n_bytes]
        return data.reshape(-1, row_bytes)

    def chunks(self, t: GGUFTensorInfo, rows: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """Dequantized float32 [n, ne0] chunks in row order; `rows` gathers rows first (a q/k un-permutation).

        For a 1-D tensor, `rows` gathers its elements instead.
        """
        qtype = GGMLQuantizationType(t.ggml_type)
        raw = self.raw_rows(t)
        if len(t.shape) == 1:
            values = quants.dequantize(np.asarray(raw), qtype)
            yield values if rows is None else values[:, rows]
            return
        if rows is not None:
            raw = raw[rows]  # whole quantized rows move, so no dequantization is needed to permute
        step = max(1, CHUNK_BYTES // (t.shape[0] * 4))
        for start in range(0, raw.shape[0], step):
            yield quants.dequantize(np.asarray(raw[start : start + step]), qtype)

    def read(self, t: GGUFTensorInfo) -> np.ndarray:
        """The whole tensor as float32 in numpy order (for small tensors such as rope_freqs)."""
        return np.concatenate(list(self.chunks(t))).reshape(tuple(reversed(t.shape)))
