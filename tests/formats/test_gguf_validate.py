"""GGUF validation: the real model matches gguf-py; truncated, fuzzed and hand-crafted bad files all raise ModelFileError."""

from __future__ import annotations

import random
import struct
from collections import Counter

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats import gguf as gguf_mod
from quantserve.formats import parse_gguf_bytes, read_gguf_info
from tests.fixtures.formats import arch_kv, gguf_bytes, gguf_kv, gguf_string, gguf_tensor_info, write_gguf


@pytest.fixture(scope="module")
def real(smollm2_gguf):
    """(file bytes, our GGUFInfo, gguf-py's reader) for the 98 MB model; loaded once."""
    return smollm2_gguf.read_bytes(), read_gguf_info(smollm2_gguf), GGUFReader(smollm2_gguf)


def test_real_model_matches_gguf_py(real, smollm2_gguf):
    data, info, reader = real
    assert (info.version, info.file_size, info.alignment) == (3, len(data), reader.alignment)
    assert info.data_offset == reader.data_offset
    assert [t.name for t in info.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(info.tensors, reader.tensors, strict=True):
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert (ours.ggml_type, ours.type_name) == (int(theirs.tensor_type), theirs.tensor_type.name)
        assert (ours.offset, ours.n_bytes) == (theirs.data_offset, theirs.n_bytes)
    assert set(info.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key in (
        "general.name",
        "llama.block_count",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.chat_template",
    ):
        assert info.metadata[key] == reader.fields[key].contents()
    assert info.metadata["llama.rope.freq_base"] == pytest.approx(
        reader.fields["llama.rope.freq_base"].contents()
    )
    tokens = info.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:50] == reader.fields["tokenizer.ggml.tokens"].contents()[:50]
    assert (
        info.metadata["tokenizer.ggml.token_type"][:50]
        == reader.fields["tokenizer.ggml.token_type"].contents()[:50]
    )
    assert (
        info.metadata["tokenizer.ggml.add_bos_token"]
        is reader.fields["tokenizer.ggml.add_bos_token"].contents()
    )
    assert (info.architecture, info.context_length, info.file_type) == ("llama", 8192, "Q4_1")
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert info.n_params == sum(int(t.n_elements) for t in reader.tensors) == 134_515_008
    assert info.get("no.such.key", 7) == 7


def test_small_read_window_grows(real, smollm2_gguf, monkeypatch):
    """read_gguf_info reads a prefix first; a header longer than it must be re-read, not misreported."""
    monkeypatch.setattr(gguf_mod, "_FIRST_READ", 4096)
    again = read_gguf_info(smollm2_gguf)
    assert again.tensors == real[1].tensors and again.metadata == real[1].metadata


def _cut_points(info) -> list[int]:
    data_end = max(t.offset + t.n_bytes for t in info.tensors)
    spread = np.linspace(0, data_end - 1, 29).astype(int).tolist()
    edges = [1, 3, 4, 7, 8, 16, 23, 24, 40, info.data_offset - 1, info.data_offset, info.data_offset + 1]
    return sorted(set(spread + edges))  # 40 cuts from the magic to the last tensor's last byte


def test_truncated_anywhere_raises_model_file_error(real):
    data, info, _ = real
    cuts = _cut_points(info)
    assert len(cuts) >= 40
    view = memoryview(data)
    for cut in cuts:
        with pytest.raises(ModelFileError) as err:
            parse_gguf_bytes(view[:cut], cut, "cut.gguf")
        assert "truncated" in err.value.message, (cut, err.value.message)
        assert err.value.message.startswith("cut.gguf: ")


def test_truncated_file_on_disk_names_the_tensor(real, tmp_path):
    data, info, _ = real
    inside_vocab = tmp_path / "vocab.gguf"
    inside_vocab.write_bytes(data[:1_000_000])
    with pytest.raises(ModelFileError, match="tokenizer.ggml"):
        read_gguf_info(inside_vocab)
    in_data = tmp_path / "data.gguf"
    with in_data.open("wb") as f:
        f.write(data[: info.data_offset])
        f.truncate(info.data_offset + 5_000_000)  # sparse: header intact, tensor data cut short
    victim = next(t for t in info.tensors if t.offset + t.n_bytes > info.data_offset + 5_000_000)
    with pytest.raises(ModelFileError) as err:
        read_gguf_info(in_data)
    msg = err.value.message
    assert (
        f"'{victim.name}'" in msg and str(victim.offset) in msg and str(info.data_offset + 5_000_000) in msg
    )


def _field_offsets(reader: GGUFReader) -> list[tuple[int, int]]:
    """(offset, width) of every length, type, count and shape field in the header, from gguf-py's view."""
    out = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        type_at = field.offset + 8 + len(field.name.encode())
        out += [(field.offset, 8), (type_at, 4)]
        if field.types[0] == GGUFValueType.ARRAY:
            out += [(type_at + 4, 4), (type_at + 8, 8)]
            if field.types[-1] == GGUFValueType.STRING:
                out.append((type_at + 16, 8))
        elif field.types[0] == GGUFValueType.STRING:
            out.append((type_at + 4, 8))
    for t in reader.tensors:
        at = t.field.offset + 8 + len(t.name.encode())
        n_dims = len(t.shape)
        out += [(t.field.offset, 8), (at, 4)] + [(at + 4 + 8 * j, 8) for j in range(n_dims)]
        out += [(at + 4 + 8 * n_dims, 4), (at + 8 + 8 * n_dims, 8)]
    return out + [(4, 4), (8, 8), (16, 8)]


@pytest.mark.slow  # thousands of mutants
def test_header_mutation_fuzz(real):
    """300 seeded mutations of the header: each parses or raises ModelFileError, nothing else escapes."""
    data, info, reader = real
    header = bytearray(data[: info.data_offset])
    fields = _field_offsets(reader)
    table_start = reader.tensors[0].field.offset
    rng = random.Random(20240607)
    boundary = {4: [0, 1, 5, 9, 13, 0x7FFFFFFF, 0xFFFFFFFF], 8: [0, 1, 2**31, 2**32, 2**62, 2**63, 2**64 - 1]}
    outcome: Counter[str] = Counter()
    for i in range(300):
        if i % 3 == 0:  # a targeted field gets a boundary or random value
            pos, width = rng.choice(fields)
            value = rng.choice(boundary[width] + [rng.getrandbits(8 * width)])
            patch = value.to_bytes(width, "little")
        elif i % 3 == 1:  # one bit flip: in the fixed header, the tensor table, or anywhere
            pos = rng.choice(
                [rng.randrange(64), rng.randrange(table_start, len(header)), rng.randrange(len(header))]
            )
            patch = bytes([header[pos] ^ (1 << rng.randrange(8))])
        else:  # a run of random bytes
            pos = rng.randrange(len(header) - 8)
            patch = rng.randbytes(rng.randrange(1, 9))
        saved = bytes(header[pos : pos + len(patch)])
        header[pos : pos + len(patch)] = patch
        try:
            parse_gguf_bytes(header, len(data), "fuzz.gguf")
            outcome["ok"] += 1
        except ModelFileError:
            outcome["error"] += 1
        except Exception as e:  # noqa: BLE001 - the point of the test is that nothing else escapes
            pytest.fail(f"mutation {i} at offset {pos} ({patch!r}) raised {type(e).__name__}: {e}")
        finally:
            header[pos : pos + len(patch)] = saved
    assert outcome["error"] >= 80 and outcome["ok"] >= 30, outcome


# ---- hand-crafted files: one per check ---------------------------------------------------------

F32, Q4_0 = 0, 2
ONE_F32 = [gguf_tensor_info("w", (8,), F32, 0)]
DATA = bytes(32)


def _crafted(**overrides) -> bytes:
    kvs, infos, data = (
        overrides.pop("kvs", [arch_kv()]),
        overrides.pop("infos", ONE_F32),
        overrides.pop("data", DATA),
    )
    return gguf_bytes(kvs, infos, data, **overrides)


def _nested(depth: int) -> bytes:
    value = struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)  # innermost: array of one u32
    for _ in range(depth - 1):
        value = struct.pack("<IQ", 9, 1) + value
    return gguf_kv("nested", 9, value)


BAD = [
    ("magic", b"GGML" + _crafted()[4:], ModelFileError, "not a GGUF file"),
    ("v1", _crafted(version=1), UnsupportedFormatError, "v1"),
    ("v4", _crafted(version=4), ModelFileError, "version 4"),
    ("big-endian", b"GGUF" + struct.pack(">IQQ", 3, 0, 0), UnsupportedFormatError, "big-endian"),
    ("tensor-count", _crafted(n_tensors=2**63), ModelFileError, "impossible"),
    ("kv-count", _crafted(n_kv=10**6), ModelFileError, "impossible"),
    ("key-length", _crafted(kvs=[struct.pack("<Q", 2**40) + b"x"]), ModelFileError, "limit"),
    ("empty-key", _crafted(kvs=[gguf_kv("", 4, struct.pack("<I", 1))]), ModelFileError, "empty key"),
    ("dup-key", _crafted(kvs=[arch_kv(), arch_kv()]), ModelFileError, "duplicate key 'general.architecture'"),
    ("bad-utf8-key", _crafted(kvs=[gguf_kv(b"\xff\xfe", 4, bytes(4))]), ModelFileError, "UTF-8"),
    ("value-type", _crafted(kvs=[gguf_kv("k", 13, bytes(8))]), ModelFileError, "unknown value type 13"),
    (
        "array-elem-type",
        _crafted(kvs=[gguf_kv("a", 9, struct.pack("<IQ", 42, 1))]),
        ModelFileError,
        "element type 42",
    ),
    ("array-count", _crafted(kvs=[gguf_kv("a", 9, struct.pack("<IQ", 0, 2**40))]), ModelFileError, "2^40"),
    ("array-depth", _crafted(kvs=[_nested(6)]), ModelFileError, "deeper"),
    ("string-value", _crafted(kvs=[gguf_kv("s", 8, struct.pack("<Q", 2**33))]), ModelFileError, "limit"),
    (
        "align-npot",
        _crafted(kvs=[gguf_kv("general.alignment", 4, struct.pack("<I", 48))]),
        ModelFileError,
        "power",
    ),
    (
        "align-zero",
        _crafted(kvs=[gguf_kv("general.alignment", 4, struct.pack("<I", 0))]),
        ModelFileError,
        "power",
    ),
    (
        "align-u64",
        _crafted(kvs=[gguf_kv("general.alignment", 10, struct.pack("<Q", 32))]),
        ModelFileError,
        "u32",
    ),
    (
        "n_dims-0",
        _crafted(infos=[gguf_string("w") + struct.pack("<IIQ", 0, F32, 0)]),
        ModelFileError,
        "n_dims 0",
    ),
    ("n_dims-5", _crafted(infos=[gguf_tensor_info("w", (1,) * 5, F32, 0)]), ModelFileError, "n_dims 5"),
    ("ne-zero", _crafted(infos=[gguf_tensor_info("w", (8, 0), F32, 0)]), ModelFileError, "invalid shape"),
    (
        "ne-overflow",
        _crafted(infos=[gguf_tensor_info("w", (2**32, 2**32), F32, 0)]),
        ModelFileError,
        "invalid shape",
    ),
    (
        "ggml-type-removed",
        _crafted(infos=[gguf_tensor_info("w", (32,), 4, 0)]),
        ModelFileError,
        "ggml type 4",
    ),
    (
        "ggml-type-huge",
        _crafted(infos=[gguf_tensor_info("w", (32,), 10**6, 0)]),
        ModelFileError,
        "unknown ggml",
    ),
    ("block-size", _crafted(infos=[gguf_tensor_info("w", (33,), Q4_0, 0)]), ModelFileError, "block size 32"),
    ("name-64", _crafted(infos=[gguf_tensor_info("n" * 64, (8,), F32, 0)]), ModelFileError, "limit 63"),
    (
        "dup-tensor",
        _crafted(infos=ONE_F32 * 2, data=bytes(64)),
        ModelFileError,
        "duplicate tensor name 'w'",
    ),
    (
        "overlap",
        _crafted(
            infos=[gguf_tensor_info("a", (8,), F32, 0), gguf_tensor_info("b", (8,), F32, 0)], data=bytes(64)
        ),
        ModelFileError,
        "overlaps 'a'",
    ),
    (
        "gap",
        _crafted(
            infos=[gguf_tensor_info("a", (8,), F32, 0), gguf_tensor_info("b", (8,), F32, 64)], data=bytes(96)
        ),
        ModelFileError,
        "expected 32",
    ),
    ("misaligned", _crafted(infos=[gguf_tensor_info("w", (8,), F32, 4)]), ModelFileError, "expected 0"),
    ("data-past-end", _crafted(data=bytes(31)), ModelFileError, "runs past the end of the file"),
    (
        "kv-truncated",
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_kv("k", 4, b"\0\0"),
        ModelFileError,
        "truncated",
    ),
]


@pytest.mark.parametrize(("blob", "exc", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_crafted_bad_files(blob, exc, needle):
    needle = needle.replace("2^40", str(2**40))
    with pytest.raises(exc) as err:
        parse_gguf_bytes(blob, len(blob), "bad.gguf")
    assert err.type is exc
    assert needle in err.value.message and err.value.message.startswith("bad.gguf: ")


def test_crafted_good_file_and_limits():
    name63 = "n" * 63
    kvs = [arch_kv(), gguf_kv("general.alignment", 4, struct.pack("<I", 64)), _nested(4)]
    kvs.append(gguf_kv("flags", 9, struct.pack("<IQ", 7, 3) + bytes([1, 0, 2])))
    infos = [gguf_tensor_info(name63, (32, 2), Q4_0, 0), gguf_tensor_info("b", (8,), F32, 64)]
    blob = gguf_bytes(kvs, infos, bytes(96), alignment=64)
    info = parse_gguf_bytes(blob, len(blob), "ok.gguf")
    assert info.alignment == 64 and info.data_offset % 64 == 0
    assert info.metadata["nested"] == [[[[7]]]] and info.metadata["flags"] == [True, False, True]
    assert [(t.name, t.shape, t.type_name, t.n_bytes) for t in info.tensors] == [
        (name63, (32, 2), "Q4_0", 36),
        ("b", (8,), "F32", 32),
    ]
    assert info.tensors[1].offset == info.data_offset + 64


def test_writer_output_and_split_metadata(tmp_path):
    first = write_gguf(tmp_path / "t.gguf", split_max_tensors=3)
    info = read_gguf_info(first)
    assert (info.split_no, info.split_count, info.get("split.tensors.count")) == (0, 2, 4)
    second = read_gguf_info(first.with_name("t-00002-of-00002.gguf"))
    assert second.split_no == 1 and "general.architecture" not in second.metadata
    with pytest.raises(ModelFileError, match="general.architecture"):
        _ = second.architecture
    whole = read_gguf_info(write_gguf(tmp_path / "w.gguf"))
    reader = GGUFReader(tmp_path / "w.gguf")
    assert [(t.name, t.type_name, t.offset) for t in whole.tensors] == [
        (t.name, t.tensor_type.name, t.data_offset) for t in reader.tensors
    ]
    assert whole.file_type == "Q4_1" and whole.context_length == 256 and whole.chat_template
