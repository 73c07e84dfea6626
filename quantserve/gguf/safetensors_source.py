"""Stream float tensors one at a time from (sharded) safetensors through a memory map, as float32.

The headers were validated by quantserve.formats (offsets inside the file, sizes matching shapes), so a
tensor is just a byte range; BF16 widens to float32 by shifting its bits, no torch involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantserve.errors import UnsupportedFormatError
from quantserve.formats import read_safetensors_header
from quantserve.formats.spec import ModelSpec
from quantserve.gguf.tensor_math import bf16_to_f32

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]  # numpy order
    path: Path
    offset: int  # absolute byte offset in path
    n_bytes: int


class SafetensorsSource:
    """All tensors of a dense checkpoint, in the order llama.cpp's converter reads them: the shards by file name,
    each shard's tensors by name (gguf-py's SafetensorsLocal), not by where their data lies (the safetensors
    library lays it out by dtype first, so a checkpoint mixing F32 and BF16 tensors differs)."""

    def __init__(self, spec: ModelSpec):
        self.directory = spec.directory
        self.tensors: dict[str, SourceTensor] = {}
        for path in sorted(spec.files, key=lambda p: p.name):
            header = read_safetensors_header(path)
            for t in sorted(header.tensors.values(), key=lambda t: t.name):
                off = header.data_offset + t.begin
                self.tensors[t.name] = SourceTensor(t.name, t.dtype, t.shape, path, off, t.n_bytes)
        self._maps: dict[Path, np.memmap] = {}

    def raw(self, name: str) -> np.ndarray:
        """A U8 tensor's bytes in its shape (MXFP4 blocks and scales), read from the map."""
        t = self.tensors[name]
        if t.dtype != "U8":
            raise UnsupportedFormatError(
                f"{t.path.name}: tensor '{name}' is {t.dtype}, not the U8 of MXFP4 data"
            )
        mm = self._maps.get(t.path)
        if mm is None:
            mm = self._maps[t.path] = np.memmap(t.path, dtype=np.uint8, mode="r")
        return np.asarray(mm[t.offset : t.offset + t.n_bytes]).reshape(t.shape)

    def read(self, name: str) -> np.ndarray:
        """The tensor as a float32 array (a fresh copy; the file is not modified).

        Raises:
            UnsupportedFormatError: a dtype other than F32, F16 or BF16.
        """
        t = self.tensors[name]
        if t.dtype not in _NUMPY:
            raise UnsupportedFormatError(
                f"{t.path.name}: tensor '{name}' is {t.dtype}; conversion reads F32, F16 and BF16 weights only"
            )
        mm = self._maps.get(t.path)
        if mm is None:
            mm = self._maps[t.path] = np.memmap(t.path, dtype=np.uint8, mode="r")
        raw = mm[t.offset : t.offset + t.n_bytes].view(_NUMPY[t.dtype]).reshape(t.shape)
        return bf16_to_f32(raw) if t.dtype == "BF16" else raw.astype(np.float32)
