"""Safe pure-Python GGUF reader: validates header, metadata and tensor table before any C code sees the file.

Longer than most modules on purpose: every bound an untrusted file could break is checked here, in one place,
so that a reader can see that nothing reaches llama.cpp unchecked.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from quantserve.errors import ModelFileError, ModelNotFoundError, UnsupportedFormatError
from quantserve.formats.gguf_hparams import check_hparams, check_tensor_types, check_vocab
from quantserve.formats.spec import GGUFInfo, GGUFTensorInfo

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # ggml's GGUF_DEFAULT_ALIGNMENT
MAX_COUNT = 1_000_000  # tensors or KV pairs; real models have a few thousand at most
MAX_KEY_BYTES = 64 * 1024
MAX_STRING_BYTES = 4 * 1024 * 1024  # chat templates reach tens of KB; nothing legitimate is near this
VOCAB_KEY = "tokenizer.ggml.tokens"
MAX_ARRAY_LEN = 1 << 24  # vocabularies are ≤ ~1M tokens
MAX_ARRAY_DEPTH = 4
MAX_TENSOR_NAME = 63  # ggml's GGML_MAX_NAME is 64 including the NUL
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_HEADER_BYTES = 512 * 1024 * 1024  # caps how much a corrupt count can make us read
INT64_MAX = (1 << 63) - 1
_FIRST_READ = 4 * 1024 * 1024

# GGUF value types (ggml gguf.h): scalar struct formats, and numpy dtypes for arrays of them.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {k: np.dtype(v) for k, v in _SCALAR.items()}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_TYPE_NAMES = {int(t): t.name for t in GGMLQuantizationType}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _NeedMoreBytes(ModelFileError):
    """The header runs past the bytes read so far, but the file is longer: read_gguf_info retries."""


def _fix(truncated: bool | None) -> str:
    """The advice that ends every message; None when the bytes cannot tell truncation from corruption."""
    what = {True: "truncated", False: "corrupt", None: "truncated or corrupt"}[truncated]
    return f"the file is {what} — download it again"


class _Parser:
    def __init__(self, buf: bytes | bytearray | memoryview, file_size: int, name: str):
        self.buf = buf
        self.size = len(buf)
        self.file_size = file_size
        self.name = name
        self.pos = 0

    def fail(self, msg: str) -> ModelFileError:
        return ModelFileError(f"{self.name}: {msg}")

    def need(self, n: int, what: str) -> None:
        if self.pos + n <= self.size:
            return
        if self.size < self.file_size:
            raise _NeedMoreBytes(
                f"{self.name}: {what} at offset {self.pos} lies beyond the first {self.size} bytes"
            )
        raise self.fail(
            f"{what} at offset {self.pos} needs {n} bytes but the file ends at {self.file_size}; "
            f"{_fix(True if n <= 8 else None)}"
        )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, cap: int, strict: bool = False) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        if n > cap:
            raise self.fail(f"{what} at offset {start} claims {n} bytes (limit {cap}); {_fix(False)}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8", "strict" if strict else "replace")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start} is not valid UTF-8; {_fix(False)}") from None

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        fmt = _SCALAR.get(vtype)
        if fmt is not None:
            n = _NUMPY[vtype].itemsize
            self.need(n, f"value of '{key}'")
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
            self.pos += n
            return v != 0 if vtype == _BOOL else v
        if vtype == _STRING:
            return self.string(f"value of '{key}'", MAX_STRING_BYTES)
        if vtype == _ARRAY:
            return self.array(key, depth)
        raise self.fail(f"key '{key}' has unknown value type {vtype} at offset {self.pos - 4}; {_fix(False)}")

    def array(self, key: str, depth: int) -> list[Any]:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"key '{key}' nests arrays deeper than {MAX_ARRAY_DEPTH}; {_fix(False)}")
        start = self.pos
        etype = self.u32(f"array element type of '{key}'")
        count = self.u64(f"array length of '{key}'")
        # the smallest encoding of one element: a scalar's size, a string's u64 length, an array's type+count
        min_size = _NUMPY[etype].itemsize if etype in _NUMPY else {_STRING: 8, _ARRAY: 12}.get(etype)
        if min_size is None:
            raise self.fail(
                f"array '{key}' at offset {start} has unknown element type {etype}; {_fix(False)}"
            )
        if count > MAX_ARRAY_LEN or count * min_size > self.file_size - self.pos:
            raise self.fail(
                f"array '{key}' at offset {start} claims {count} elements of ≥{min_size} bytes but only "
                f"{self.file_size - self.pos} bytes follow; {_fix(None)}"
            )
        if etype in _NUMPY:
            dt = _NUMPY[etype]
            self.need(count * dt.itemsize, f"array '{key}'")
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            return (arr != 0).tolist() if etype == _BOOL else arr.tolist()
        if etype == _STRING:
            return self.string_array(key, count)
        return [self.array(key, depth + 1) for _ in range(count)]

    def string_array(self, key: str, count: int) -> list[str]:
        # The hot loop for 50k–250k token vocabularies: locals only, one bounds check per element.
        buf, size, pos, unpack, out = self.buf, self.size, self.pos, _U64.unpack_from, []
        append = out.append
        # llama.cpp maps each token's text back to its id and asserts that no two tokens share it (GGML_ASSERT in
        # llama-vocab.cpp: the whole process aborts). It reads the text as a C string, so it ends at the first NUL
        # byte, and an empty one is renamed "[EMPTY_<i>]". So a vocabulary is checked here on those bytes, as
        # llama.cpp sees them (decoding with "replace" could merge distinct ones).
        seen: dict[bytes, int] | None = {} if key == VOCAB_KEY else None
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of element {i} of '{key}'")
            (n,) = unpack(buf, pos)
            end = pos + 8 + n
            if n > MAX_STRING_BYTES or end > size:
                self.pos = pos
                if n > MAX_STRING_BYTES or end > self.file_size:
                    raise self.fail(
                        f"element {i} of '{key}' at offset {pos} claims {n} bytes (limit {MAX_STRING_BYTES}, "
                        f"file size {self.file_size}); {_fix(False if n > MAX_STRING_BYTES else None)}"
                    )
                self.need(8 + n, f"element {i} of '{key}'")
            append(str(buf[pos + 8 : end], "utf-8", "replace"))
            if seen is not None:
                raw = bytes(buf[pos + 8 : end])
                text = raw.split(b"\0", 1)[0] or f"[EMPTY_{i}]".encode()
                first = seen.setdefault(text, i)
                if first != i:
                    self.pos = pos
                    cut = f" (its bytes {raw!r} end at the NUL for llama.cpp)" if text != raw else ""
                    raise self.fail(
                        f"'{key}' holds the token {text!r} twice (ids {first} and {i}){cut}; llama.cpp would abort "
                        f"on this vocabulary; {_fix(False)}"
                    )
            pos = end
        self.pos = pos
        return out


def _file_type_name(metadata: dict[str, Any], tensors: tuple[GGUFTensorInfo, ...]) -> str:
    value = metadata.get("general.file_type")
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            name = LlamaFileType(value).name
        except ValueError:
            return f"unknown ({value})"
        return "F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_")
    # no general.file_type: name the commonest type among matrices (1-D norms stay F32 in every mix)
    counts: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) >= 2:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "F32"


def parse_gguf_bytes(
    buf: bytes | bytearray | memoryview, file_size: int, path: str | os.PathLike[str] = "<memory>"
) -> GGUFInfo:
    """Parse and validate a GGUF header held in memory.

    Args:
        buf: the file's bytes from offset 0; a prefix is enough if it holds the whole header.
        file_size: the size of the whole file, used to bound counts and check tensor data ranges.
        path: used in error messages and stored in the result.
    Raises:
        ModelFileError: any structural problem (UnsupportedFormatError for v1 and big-endian files).
    """
    path = Path(path)
    p = _Parser(buf, file_size, path.name)
    p.need(4, "magic")
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise p.fail(f"not a GGUF file: starts with {magic!r}, expected {GGUF_MAGIC!r}")
    p.pos = 4
    version = p.u32("version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and (version >> 24) in (1, 2, 3):
            raise UnsupportedFormatError(
                f"{p.name}: big-endian GGUF (version reads as {version:#x}) is not supported; "
                "convert it with `gguf-convert-endian FILE little`"
            )
        if version == 1:
            raise UnsupportedFormatError(
                f"{p.name}: GGUF v1 is not supported; re-convert with a current llama.cpp"
            )
        raise p.fail(f"unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors = p.u64("tensor count")
    n_kv = p.u64("KV count")
    # every tensor info takes ≥ 32 bytes and every KV pair ≥ 13, so the counts are bounded by the file size
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT or n_tensors * 32 + n_kv * 13 > file_size - p.pos:
        raise p.fail(
            f"header claims {n_tensors} tensors and {n_kv} KV pairs, impossible in a {file_size}-byte file; "
            f"{_fix(None)}"
        )
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key_at = p.pos
        key = p.string(f"key of KV pair {i}", MAX_KEY_BYTES, strict=True)
        if not key:
            raise p.fail(f"KV pair {i} at offset {key_at} has an empty key; {_fix(False)}")
        if key in metadata:
            raise p.fail(f"duplicate key '{key}' at offset {key_at}; {_fix(False)}")
        vtype = p.u32(f"value type of '{key}'")
        metadata[key] = p.value(vtype, key)
        if key == "general.alignment":
            a = metadata[key]
            if vtype != 4 or a == 0 or a & (a - 1):
                shown = a if vtype == 4 else f"a value of GGUF type {vtype}"
                raise p.fail(f"general.alignment must be a u32 power of two, got {shown}; {_fix(False)}")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)

    infos: list[tuple[str, tuple[int, ...], int, int, int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = p.pos
        name = p.string(f"name of tensor {i}", MAX_TENSOR_NAME, strict=True)
        if name in names:
            raise p.fail(f"duplicate tensor name '{name}' at offset {at}; {_fix(False)}")
        names.add(name)
        n_dims = p.u32(f"n_dims of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise p.fail(
                f"tensor '{name}' at offset {at} has n_dims {n_dims} (expected 1..{MAX_DIMS}); {_fix(False)}"
            )
        shape = tuple(p.u64(f"ne[{j}] of tensor '{name}'") for j in range(n_dims))
        n_el = 1
        for d in shape:
            n_el *= d
        if min(shape) < 1 or n_el > INT64_MAX:
            raise p.fail(f"tensor '{name}' at offset {at} has invalid shape {list(shape)}; {_fix(False)}")
        gtype = p.u32(f"type of tensor '{name}'")
        if gtype not in _TYPE_NAMES or GGMLQuantizationType(gtype) not in GGML_QUANT_SIZES:
            raise p.fail(f"tensor '{name}' at offset {at} has unknown ggml type {gtype}; {_fix(False)}")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        if shape[0] % block:
            raise p.fail(
                f"tensor '{name}' of type {_TYPE_NAMES[gtype]} has {shape[0]} elements per row, "
                f"not a multiple of its block size {block}; {_fix(False)}"
            )
        offset = p.u64(f"data offset of tensor '{name}'")
        infos.append((name, shape, gtype, offset, n_el // block * type_size, at))

    data_offset = -(-p.pos // alignment) * alignment
    tensors: list[GGUFTensorInfo] = []
    expected, prev = 0, None
    for name, shape, gtype, offset, n_bytes, at in infos:
        # llama.cpp requires table order and contiguity: each offset equals the padded end of the previous
        if offset != expected:
            where = f"overlaps '{prev}', which ends at {expected}" if offset < expected else "leaves a gap"
            raise p.fail(
                f"tensor '{name}' (table entry at offset {at}) has data offset {offset}, expected {expected}: "
                f"it {where}; {_fix(False)}"
            )
        start = data_offset + offset
        if start + n_bytes > file_size:
            raise p.fail(
                f"tensor '{name}' data [offset {start}, {n_bytes} bytes] runs past the end of the file "
                f"(size {file_size}); {_fix(True)}"
            )
        tensors.append(GGUFTensorInfo(name, shape, gtype, _TYPE_NAMES[gtype], start, n_bytes))
        expected = offset + -(-n_bytes // alignment) * alignment
        prev = name
    info = tuple(tensors)
    check_hparams(str(path), metadata, [t.name for t in info])
    check_vocab(str(path), metadata)
    check_tensor_types(str(path), info)
    return GGUFInfo(
        path, version, file_size, alignment, data_offset, metadata, info, _file_type_name(metadata, info)
    )


def read_gguf_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read and validate a GGUF file's header, metadata and tensor table (tensor data is not read).

    Raises:
        ModelNotFoundError: the path does not exist.
        ModelFileError: not a GGUF file, or malformed/truncated (UnsupportedFormatError: v1 or big-endian).
    """
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(
            f"{path}: not a regular file; pass a .gguf file (or use detect() for a directory)"
        )
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            want = min(file_size, _FIRST_READ)
            while True:
                f.seek(0)
                buf = f.read(want)
                try:
                    return parse_gguf_bytes(buf, file_size, path)
                except _NeedMoreBytes:
                    if want >= file_size:  # read everything and still short: the file shrank under us
                        raise ModelFileError(
                            f"{path.name}: the file changed size while being read; retry when it is complete"
                        ) from None
                    if want >= MAX_HEADER_BYTES:
                        raise ModelFileError(
                            f"{path.name}: the GGUF header is larger than {MAX_HEADER_BYTES} bytes; {_fix(False)}"
                        ) from None
                    want = min(file_size, want * 4, MAX_HEADER_BYTES)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror}); check its permissions") from None
