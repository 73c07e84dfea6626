"""Mutated and truncated copies of the real GGUF, validated and then opened by llama.cpp in a child process:
the child either loads the model or exits 2 with a clear error; it is never killed by a signal."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys

import pytest

from quantserve.formats import read_gguf_info

# Validate, then load with llama.cpp exactly as the server does. Exit 2 on a user-facing error.
CHILD = """
import sys
from pathlib import Path
from quantserve.errors import QuantserveError
from quantserve.formats import read_gguf_info
from quantserve.backends.llamacpp.model import LlamaCppRunner
from quantserve.core.settings import EngineSettings
try:
    read_gguf_info(sys.argv[1])
    LlamaCppRunner(Path(sys.argv[1]), EngineSettings(ctx_size=256, max_num_seqs=1, threads=1)).close()
except QuantserveError as exc:
    print("error:", exc.message, file=sys.stderr)
    sys.exit(2)
"""


def _load(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def work_copy(smollm2_gguf, tmp_path_factory):
    dst = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    shutil.copyfile(smollm2_gguf, dst)
    return dst


def _mutations(data_offset: int, n: int, seed: int = 1234):
    rng = random.Random(seed)
    hot = [
        8,
        16,
        24,
    ]  # tensor_count, kv_count and the first key length: the fields that size everything after
    for i in range(n):
        if i < len(hot):
            yield hot[i], rng.choice([b"\xff" * 8, b"\x00" * 8, (2**40).to_bytes(8, "little")])
        else:
            yield rng.randrange(4, data_offset), bytes([rng.randrange(256)])


def test_header_mutations_never_crash_llama_cpp(work_copy):
    info = read_gguf_info(work_copy)
    outcomes = {0: 0, 2: 0}
    with work_copy.open("r+b") as f:
        for offset, patch in _mutations(info.data_offset, 24):
            f.seek(offset)
            original = f.read(len(patch))
            f.seek(offset)
            f.write(patch)
            f.flush()
            r = _load(work_copy)
            f.seek(offset)
            f.write(original)
            f.flush()
            assert r.returncode in (0, 2), f"offset {offset}: exit {r.returncode}\n{r.stderr[-2000:]}"
            if r.returncode == 2:
                assert "error:" in r.stderr
            outcomes[r.returncode] += 1
    assert outcomes[2] >= 3  # the size fields above are always caught


def test_truncated_copies_exit_2_with_a_clear_error(smollm2_gguf, tmp_path):
    size = smollm2_gguf.stat().st_size
    data = smollm2_gguf.read_bytes()
    for cut in (3, 20, 5_000, 1_500_000, size // 2, size - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        r = _load(p)
        assert r.returncode == 2, f"cut at {cut}: exit {r.returncode}\n{r.stderr[-2000:]}"
        assert "truncated" in r.stderr or "too small" in r.stderr or "GGUF" in r.stderr, r.stderr
        p.unlink()


def test_data_corruption_still_loads(work_copy):
    info = read_gguf_info(work_copy)
    with work_copy.open("r+b") as f:
        f.seek(info.data_offset + 12345)
        original = f.read(64)
        f.seek(info.data_offset + 12345)
        f.write(b"\xff" * 64)
        f.flush()
        r = _load(work_copy)
        f.seek(info.data_offset + 12345)
        f.write(original)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("value", [0, 513, 100_000, 0xFFFFFFFF])
def test_block_count_that_aborts_llama_cpp_is_refused_first(work_copy, value):
    """Found by fuzzing: llama.cpp aborts (SIGABRT) on these; the validator must refuse them."""
    import struct

    key = b"llama.block_count"
    head = work_copy.read_bytes()[:4_000_000]
    at = head.find(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # past the key and its value type
    with work_copy.open("r+b") as f:
        f.seek(at)
        original = f.read(4)
        f.seek(at)
        f.write(struct.pack("<I", value))
        f.flush()
        r = _load(work_copy)
        f.seek(at)
        f.write(original)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "block_count" in r.stderr


# llama.cpp alone, without our validator: the oracle for what it survives.
RAW_CHILD = """
import sys
import llama_cpp as lc
lc.llama_backend_init()
params = lc.llama_model_default_params()
params.vocab_only = True
model = lc.llama_model_load_from_file(sys.argv[1].encode(), params)
sys.exit(0 if model else 3)
"""


def test_vocabulary_with_a_repeated_token_is_refused_before_llama_cpp_aborts(work_copy, tmp_path):
    """Found by a fuzz run: two equal token strings pass a structural check, and llama.cpp then aborts the whole
    process (GGML_ASSERT id_to_token.size() == token_to_id.size()). The validator must refuse the file."""
    import struct

    info = read_gguf_info(work_copy)
    tokens = info.metadata["tokenizer.ggml.tokens"]
    a = next(i for i in range(1000, len(tokens)) if len(tokens[i].encode()) == len(tokens[i + 1].encode()))
    data = bytearray(work_copy.read_bytes())
    raw_a, raw_b = (struct.pack("<Q", len(t.encode())) + t.encode() for t in (tokens[a], tokens[a + 1]))
    at = data.find(raw_a + raw_b)
    assert at > 0
    data[at + len(raw_a) : at + 2 * len(raw_a)] = raw_a  # token a + 1 becomes a copy of token a
    bad = tmp_path / "repeated-token.gguf"
    bad.write_bytes(data)
    _aborts_llama_cpp_but_is_refused(bad, rf"twice \(ids {a} and {a + 1}\)")


def _aborts_llama_cpp_but_is_refused(bad, match: str) -> None:
    """llama.cpp alone dies on `bad`; our validator refuses it with a message matching `match`, and so does a
    load through our loader in a child."""
    from quantserve.errors import ModelFileError

    raw = subprocess.run([sys.executable, "-c", RAW_CHILD, str(bad)], capture_output=True, timeout=120)
    assert raw.returncode < 0, "llama.cpp no longer aborts on this file; the check may be relaxed"
    with pytest.raises(ModelFileError, match=match):
        read_gguf_info(bad)
    r = _load(bad)
    assert r.returncode == 2 and "twice" in r.stderr, r.stderr[-2000:]


def _token_with_nul(work_copy, tmp_path):
    """SmolLM2 with one token's bytes overwritten as in a real report: 'Ġ', a NUL, then bytes of the same length.
    llama.cpp reads the text up to the NUL, 'Ġ', which is already a token."""
    import struct

    tokens = read_gguf_info(work_copy).metadata["tokenizer.ggml.tokens"]
    space = tokens.index("Ġ")
    new = "Ġ".encode() + b"\x00\x00\x00\x80\x00\x00\x00\x00ve"
    victim = next(
        i
        for i in range(1000, len(tokens))
        if tokens[i].startswith("Ġ") and len(tokens[i].encode()) == len(new)
    )
    old = tokens[victim].encode()
    data = bytearray(work_copy.read_bytes())
    at = data.find(struct.pack("<Q", len(old)) + old) + 8
    data[at : at + len(old)] = new
    bad = tmp_path / "nul-token.gguf"
    bad.write_bytes(data)
    return bad, space, victim


def test_token_text_cut_at_a_nul_that_repeats_another_is_refused(work_copy, tmp_path):
    """llama.cpp reads token texts as C strings: bytes that differ after a NUL make the same text, and it aborts.
    The validator sees the texts as llama.cpp does, so every way a user loads the file refuses it: `inspect`,
    `quantserve run` (before it listens) and `quantserve.load()`, each with exit 2 and the reason."""
    bad, space, victim = _token_with_nul(work_copy, tmp_path)
    _aborts_llama_cpp_but_is_refused(bad, rf"twice \(ids {space} and {victim}\).*end at the NUL")
    cli = [sys.executable, "-m", "quantserve.cli"]
    for args in (["inspect", str(bad)], ["run", str(bad), "--port", "1"]):
        r = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and f"ids {space} and {victim}" in r.stderr, (args, r.stderr[-2000:])
    load = (
        "import sys, quantserve\nfrom quantserve.errors import QuantserveError\ntry:\n"
        "    quantserve.load(sys.argv[1])\nexcept QuantserveError as exc:\n"
        "    print('error:', exc.message, file=sys.stderr); sys.exit(2)\n"
    )
    r = subprocess.run([sys.executable, "-c", load, str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "end at the NUL for llama.cpp" in r.stderr, r.stderr[-2000:]
