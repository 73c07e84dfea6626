"""Streaming safetensors writer: headers first, then each tensor's bytes in chunks, sharded like HF above ~2 GB.

The safetensors library's save_file needs every tensor in memory at once; writing the (simple) format
ourselves keeps peak memory at one chunk. Layout per file: u64 little-endian header length, the JSON header
(padded with spaces to 8 bytes, as the reference writer does), then the tensors back to back in header order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

SHARD_BYTES = 2 * 10**9  # start a new shard beyond this, like transformers' max_shard_size="2GB"
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors spelling: "BF16", "F16", "F32", "F8_E4M3"
    shape: tuple[int, ...]  # numpy order ([out, in] for a linear weight)

    @property
    def n_bytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _header(tensors: list[PlannedTensor]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        entries[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.n_bytes],
        }
        offset += t.n_bytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


class SafetensorsWriter:
    """Write `tensors` (in this order) into `directory` as model.safetensors or model-0000i-of-0000n shards.

    Use as a context manager; call `write(name, chunks)` once per tensor in plan order. Leaving the block
    normally finishes the files (and the shard index); leaving it by an exception only closes them.
    """

    def __init__(self, directory: Path, tensors: list[PlannedTensor], shard_bytes: int = SHARD_BYTES):
        self.directory = directory
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in tensors:
            if shards[-1] and size + t.n_bytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.n_bytes
        n = len(shards)
        self.files = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        )
        self._shards = shards
        self._order = [(i, t) for i, shard in enumerate(shards) for t in shard]
        self._next = 0
        self._fp: IO[bytes] | None = None
        self._shard = -1

    def write(self, name: str, chunks: Iterable[np.ndarray]) -> None:
        shard, planned = self._order[self._next]
        if name != planned.name:
            raise ValueError(f"expected tensor {planned.name!r} next, got {name!r}")
        if shard != self._shard:
            self._open(shard)
        assert self._fp is not None
        written = 0
        for chunk in chunks:
            data = np.ascontiguousarray(chunk)
            self._fp.write(data.data)
            written += data.nbytes
        if written != planned.n_bytes:
            raise ValueError(f"tensor {name!r}: wrote {written} bytes, planned {planned.n_bytes}")
        self._next += 1

    def _open(self, shard: int) -> None:
        if self._fp:
            self._fp.close()
        self._fp = (self.directory / self.files[shard]).open("wb")
        header = _header(self._shards[shard])
        self._fp.write(struct.pack("<Q", len(header)) + header)
        self._shard = shard

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        elif self._fp:
            self._fp.close()
            self._fp = None

    def close(self) -> None:
        """Finish the last file and, for shards, write model.safetensors.index.json."""
        if self._fp:
            self._fp.close()
            self._fp = None
        if self._next != len(self._order):
            raise ValueError(f"only {self._next} of {len(self._order)} planned tensors were written")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": sum(t.n_bytes for _, t in self._order)},
                "weight_map": {t.name: self.files[i] for i, t in self._order},
            }
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
