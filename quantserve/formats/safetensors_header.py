"""Safe safetensors header reader: parses and validates the JSON header only, never the tensor data."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError, ModelNotFoundError
from quantserve.formats.spec import SafetensorsHeader, SafetensorsTensor

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference loader's own limit is 100 MB

# Bits per element of every dtype the safetensors library (0.8) knows; sub-byte floats pack densely.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}

_REDOWNLOAD = "the file is truncated or corrupt — download it again"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # json.loads would silently keep the last one; the Rust loader refuses the file
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_safetensors_header(
    prefix: bytes, file_size: int, path: str | os.PathLike[str] = "<memory>"
) -> SafetensorsHeader:
    """Validate a safetensors header given the file's first bytes (at least 8 + header length).

    Checks: the length prefix against the file size and MAX_HEADER_BYTES; a JSON object without duplicate
    keys; string-to-string `__metadata__`; per tensor a known dtype, a shape of non-negative ints,
    data_offsets in range with `end - begin == prod(shape) * itemsize`; tensors that tile the data
    section exactly (no overlap, no gap, nothing trailing), as the reference loader requires.

    Raises:
        ModelFileError: with the file name, offsets and sizes involved.
    """
    path = Path(path)
    name = path.name
    if file_size < 8 or len(prefix) < 8:
        raise ModelFileError(f"{name}: {file_size} bytes is too small for a safetensors file; {_REDOWNLOAD}")
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n > MAX_HEADER_BYTES:
        raise ModelFileError(
            f"{name}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; {_REDOWNLOAD}"
        )
    if 8 + n > file_size:
        raise ModelFileError(
            f"{name}: header length {n} runs past the end of the file (size {file_size}); {_REDOWNLOAD}"
        )
    if len(prefix) < 8 + n:
        raise ModelFileError(
            f"{name}: only {len(prefix)} header bytes available, need {8 + n}; {_REDOWNLOAD}"
        )
    raw = bytes(prefix[8 : 8 + n])
    if not raw.startswith(b"{"):
        raise ModelFileError(
            f"{name}: header at offset 8 does not start with '{{' (got {raw[:8]!r}); not safetensors"
        )
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFileError(f"{name}: the {n}-byte JSON header is invalid ({e}); {_REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{name}: the JSON header is a {type(header).__name__}, expected an object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelFileError(f"{name}: __metadata__ must map strings to strings, got {str(metadata)[:200]}")

    data_size = file_size - 8 - n
    tensors: dict[str, SafetensorsTensor] = {}
    for tname, entry in header.items():
        if not isinstance(entry, dict):
            raise ModelFileError(
                f"{name}: tensor '{tname}' entry is {str(entry)[:100]!r}, expected an object"
            )
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise ModelFileError(f"{name}: tensor '{tname}' has unknown dtype {str(dtype)[:40]!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ModelFileError(f"{name}: tensor '{tname}' has invalid shape {str(shape)[:100]}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ModelFileError(f"{name}: tensor '{tname}' has invalid data_offsets {str(offsets)[:100]}")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise ModelFileError(f"{name}: tensor '{tname}' has data_offsets [{begin}, {end}] out of order")
        if end > data_size:
            raise ModelFileError(
                f"{name}: tensor '{tname}' data [file offset {8 + n + begin}, {end - begin} bytes] runs past the "
                f"end of the file (size {file_size}); {_REDOWNLOAD}"
            )
        t = SafetensorsTensor(tname, dtype, tuple(shape), begin, end)
        bits = t.n_elements * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != end - begin:
            raise ModelFileError(
                f"{name}: tensor '{tname}' is {dtype} {list(shape)} = {bits / 8:g} bytes but its data_offsets "
                f"span {end - begin} bytes; {_REDOWNLOAD}"
            )
        tensors[tname] = t

    expected, prev = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < expected:
            raise ModelFileError(
                f"{name}: tensor '{t.name}' data [{t.begin}, {t.end}) overlaps '{prev}' (ends at {expected}); {_REDOWNLOAD}"
            )
        if t.begin > expected:
            raise ModelFileError(
                f"{name}: {t.begin - expected} unused bytes before tensor '{t.name}' at data offset {expected}; "
                f"{_REDOWNLOAD}"
            )
        expected, prev = t.end, t.name
    if expected != data_size:
        raise ModelFileError(
            f"{name}: tensors cover {expected} data bytes but the file holds {data_size} after the header "
            f"({data_size - expected} trailing bytes); {_REDOWNLOAD}"
        )
    return SafetensorsHeader(path, file_size, n, dict(metadata), tensors)


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of one .safetensors file (reads 8 + header length bytes only).

    Raises:
        ModelNotFoundError: the path does not exist.
        ModelFileError: malformed, truncated or not safetensors.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such file")
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                if n <= MAX_HEADER_BYTES and 8 + n <= file_size:
                    head += f.read(n)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror}); check its permissions") from None
    return parse_safetensors_header(head, file_size, path)
