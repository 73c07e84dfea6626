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
    info = read_gguf_info(sys.argv[1])
    LlamaCppRunner(Path(sys.argv[1]), EngineSettings(ctx_size=256, max_num_seqs=1, threads=1),
                   n_ctx_train=info.context_length).close()
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
