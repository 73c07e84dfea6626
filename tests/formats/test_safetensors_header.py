"""safetensors header validation: real files match the reference library; every malformed header is refused."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from quantserve.errors import ModelFileError, ModelNotFoundError
from quantserve.formats import parse_safetensors_header, read_safetensors_header
from tests.fixtures.formats import dense_tensors, write_raw_safetensors


def test_matches_reference_library(tmp_path):
    tensors = dense_tensors() | {
        "ids": np.arange(5, dtype=np.int64),
        "scalar": np.array(3.0, dtype=np.float32),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = read_safetensors_header(path)
    assert header.metadata == {"format": "pt"} and header.file_size == path.stat().st_size
    with safe_open(str(path), framework="np") as f:
        assert sorted(header.tensors) == sorted(f.keys())
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            assert header.tensors[name].shape == tuple(f.get_slice(name).get_shape())
    assert header.tensors["ids"].dtype == "I64" and header.tensors["scalar"].shape == ()
    raw = path.read_bytes()
    for name, t in header.tensors.items():  # offsets point at the exact bytes of each tensor
        got = raw[header.data_offset + t.begin : header.data_offset + t.end]
        assert got == np.ascontiguousarray(tensors[name]).tobytes()


def test_bf16_and_empty_tensors(tmp_path):
    path = write_raw_safetensors(
        tmp_path / "b.safetensors", {"w": ("BF16", [2, 3], bytes(12)), "empty": ("F32", [0, 4], b"")}
    )
    header = read_safetensors_header(path)
    assert header.tensors["w"].n_bytes == 12 and header.tensors["empty"].n_elements == 0


def _blob(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _t(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD = [
    ("tiny", b"\x01\x02", "too small"),
    ("length-past-end", _blob({"a": _t()}, bytes(8), length=10_000), "runs past the end"),
    ("length-huge", _blob(b"{}", length=2**40), "exceeds"),
    ("not-json", _blob(b"{not json}"), "invalid"),
    ("not-utf8", _blob(b'{"\xff": 1}'), "invalid"),
    ("not-object", _blob(b"[1, 2]"), "does not start with"),
    ("dup-key", _blob(b'{"a": {}, "a": {}}'), "duplicate key"),
    ("entry-not-object", _blob({"a": [1]}), "expected an object"),
    ("unknown-dtype", _blob({"a": _t(dtype="F17")}, bytes(8)), "unknown dtype"),
    ("negative-dim", _blob({"a": _t(shape=(-2,))}, bytes(8)), "invalid shape"),
    ("bool-dim", _blob({"a": _t(shape=(True,))}, bytes(4)), "invalid shape"),
    ("float-offset", _blob({"a": _t(offsets=(0.0, 8))}, bytes(8)), "invalid data_offsets"),
    (
        "three-offsets",
        _blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}, bytes(8)),
        "invalid",
    ),
    ("reversed", _blob({"a": _t(offsets=(8, 0))}, bytes(8)), "out of order"),
    ("past-data", _blob({"a": _t(offsets=(0, 8))}, bytes(4)), "runs past the end"),
    ("size-mismatch", _blob({"a": _t(shape=(3,))}, bytes(8)), "12 bytes but its data_offsets span 8"),
    ("overlap", _blob({"a": _t(), "b": _t(offsets=(4, 12))}, bytes(12)), "overlaps 'a'"),
    ("gap", _blob({"a": _t(offsets=(8, 16))}, bytes(16)), "8 unused bytes"),
    ("trailing", _blob({"a": _t()}, bytes(12)), "4 trailing bytes"),
    ("metadata-type", _blob({"__metadata__": {"k": 1}}), "strings to strings"),
]


@pytest.mark.parametrize(("blob", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_headers(blob, needle):
    with pytest.raises(ModelFileError) as err:
        parse_safetensors_header(blob, len(blob), "bad.safetensors")
    assert err.type is ModelFileError
    assert needle in err.value.message and err.value.message.startswith("bad.safetensors: ")


def test_truncation_and_mutation_fuzz(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(dense_tensors(), str(path))
    raw = path.read_bytes()
    for cut in np.linspace(0, len(raw) - 1, 60).astype(int):
        with pytest.raises(ModelFileError):
            parse_safetensors_header(raw[:cut], int(cut), "cut.safetensors")
    header_end = 8 + struct.unpack_from("<Q", raw)[0]
    rng = random.Random(7)
    errors = 0
    for i in range(400):
        buf = bytearray(raw)
        pos = rng.randrange(header_end)
        buf[pos] = rng.choice(
            [buf[pos] ^ (1 << rng.randrange(8)), rng.randrange(256), ord(rng.choice('{}[]",:0-9e'))]
        )
        try:
            parse_safetensors_header(bytes(buf), len(buf), "fuzz.safetensors")
        except ModelFileError:
            errors += 1
        except Exception as e:  # noqa: BLE001 - nothing but ModelFileError may escape
            pytest.fail(f"mutation {i} at {pos} raised {type(e).__name__}: {e}")
    assert errors > 200


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError):
        read_safetensors_header(tmp_path / "none.safetensors")
