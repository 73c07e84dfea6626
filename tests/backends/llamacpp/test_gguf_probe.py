"""The llama.cpp probe: a GGUF loaded and run for one token in a child process, so that an abort in llama.cpp's C
code becomes a ModelFileError here; and its cache, which probes each version of a file once."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest

from quantserve.backends.llamacpp import probe
from quantserve.backends.llamacpp.probe import ProbeCache, ProbeCrashError, probe_gguf
from quantserve.errors import ModelFileError
from quantserve.formats import read_gguf_info
from tests.fixtures.gguf_mutants import ABORTING, PASSING, write_aborting_gguf, write_mutant


def test_the_real_gguf_probes_ok(smollm2_gguf):
    assert probe_gguf(smollm2_gguf) > 0


def test_a_truncated_copy_is_refused_with_the_validators_message(smollm2_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[: smollm2_gguf.stat().st_size // 2])
    with pytest.raises(ModelFileError) as validator:
        read_gguf_info(cut)
    with pytest.raises(ModelFileError) as probed:
        probe_gguf(cut)
    assert type(probed.value) is ModelFileError  # a clean refusal, not a crash
    assert probed.value.message == validator.value.message
    assert "runs past the end of the file" in probed.value.message


def test_a_file_that_passes_the_validator_but_aborts_llama_cpp_is_refused(smollm2_gguf, tmp_path):
    bad = tmp_path / "aborts.gguf"
    description = write_aborting_gguf(smollm2_gguf, bad)
    read_gguf_info(bad)  # passes our checks: only the probe can catch it
    with pytest.raises(ProbeCrashError, match="killed by SIGABRT") as exc:
        probe_gguf(bad)
    assert exc.value.returncode == -6
    assert "binary_op: unsupported types" in exc.value.detail, description
    assert "would have killed the server" in exc.value.message
    assert str(bad) in exc.value.message


@pytest.mark.parametrize("mutant", ABORTING, ids=lambda m: m.description.split(";")[0])
def test_every_known_abort_is_contained(smollm2_gguf, tmp_path, mutant):
    """Each of these made llama.cpp abort when found; refused by the validator (once a check closes the hole) or
    contained by the probe, it is a ModelFileError here, and this process lives on."""
    bad = tmp_path / "mutant.gguf"
    write_mutant(smollm2_gguf, bad, mutant)
    with pytest.raises(ModelFileError):
        probe_gguf(bad)


@pytest.mark.parametrize("mutant", ABORTING, ids=lambda m: m.description.split(";")[0])
def test_the_validator_refuses_every_known_abort_but_two(smollm2_gguf, tmp_path, mutant):
    bad = tmp_path / "mutant.gguf"
    write_mutant(smollm2_gguf, bad, mutant)
    if mutant in PASSING:
        read_gguf_info(bad)
    else:
        with pytest.raises(ModelFileError, match="(?i)convert"):
            read_gguf_info(bad)


def test_the_projector_is_loaded_too(smollm2_gguf):
    """A text model as its own projector: the child's runner refuses it (the text model has no <image> token)."""
    with pytest.raises(ModelFileError, match="no <image> token") as exc:
        probe_gguf(smollm2_gguf, mmproj=smollm2_gguf)
    assert type(exc.value) is ModelFileError


def test_a_probe_past_its_timeout_is_refused(smollm2_gguf):
    with pytest.raises(ProbeCrashError, match="longer than 0.01 s") as exc:
        probe_gguf(smollm2_gguf, timeout=0.01)
    assert exc.value.returncode is None


@pytest.fixture
def counted(monkeypatch):
    """probe_gguf as the cache calls it, counting launches."""
    calls = []
    real = probe.probe_gguf

    def counting(path, **kw):
        calls.append(path)
        return real(path, **kw)

    monkeypatch.setattr(probe, "probe_gguf", counting)
    return calls


def test_the_cache_probes_a_file_once_and_again_when_it_changes(smollm2_gguf, tmp_path, counted):
    model = tmp_path / "m.gguf"
    shutil.copyfile(smollm2_gguf, model)
    cache = ProbeCache()
    cache.check(model)
    cache.check(model)
    cache.check(tmp_path / "." / "m.gguf")  # the same file by another spelling
    assert len(counted) == 1
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    cache.check(model)
    assert len(counted) == 2


def test_the_cache_remembers_a_failure(smollm2_gguf, tmp_path, counted):
    bad = tmp_path / "aborts.gguf"
    write_aborting_gguf(smollm2_gguf, bad)
    cache = ProbeCache()
    for _ in range(2):
        with pytest.raises(ModelFileError, match="SIGABRT"):
            cache.check(bad)
    assert len(counted) == 1


def test_concurrent_checks_of_one_file_probe_it_once(smollm2_gguf, monkeypatch):
    calls = []

    def slow(path, **kw):
        calls.append(path)
        time.sleep(0.2)
        return 0.2

    monkeypatch.setattr(probe, "probe_gguf", slow)
    cache = ProbeCache()
    threads = [threading.Thread(target=cache.check, args=(smollm2_gguf,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def test_a_pass_kept_on_disk_spares_another_process_the_probe(smollm2_gguf, tmp_path, counted, caplog):
    """A new ProbeCache stands for a new process: it finds the pass in the store and does not probe; the same file
    rewritten in place (same path, size and mtime, new bytes) is probed again; no failure is kept on disk."""
    model, store = tmp_path / "m.gguf", tmp_path / "probes"
    shutil.copyfile(smollm2_gguf, model)
    ProbeCache().check(model, store=store)
    assert len(counted) == 1 and len(list(store.glob("*.json"))) == 1
    with caplog.at_level("INFO", logger="quantserve"):
        ProbeCache().check(model, store=store)
    assert len(counted) == 1 and "not probed again" in caplog.text

    st = model.stat()
    time.sleep(0.01)
    model.write_bytes(model.read_bytes())  # new bytes in place (here the same), the mtime then set back
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (model.stat().st_size, model.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    ProbeCache().check(model, store=store)
    assert len(counted) == 2

    bad = tmp_path / "aborts.gguf"
    write_aborting_gguf(smollm2_gguf, bad)
    with pytest.raises(ModelFileError, match="SIGABRT"):
        ProbeCache().check(bad, store=store)
    assert len(list(store.glob("*.json"))) == 2  # the two passes of m.gguf's versions, no failure


@pytest.mark.parametrize(
    "entry",
    ['{"key": ', "[]", '{"key": {"files": [], "llama.cpp": "x"}, "passed": true}', None],
    ids=["torn", "not-an-object", "another-key", "not-passed"],
)
def test_a_corrupt_probe_entry_is_ignored_and_written_anew(smollm2_gguf, tmp_path, counted, entry, caplog):
    store = tmp_path / "probes"
    ProbeCache().check(smollm2_gguf, store=store)
    (path,) = store.glob("*.json")
    kept = json.loads(path.read_text())
    path.write_text(entry if entry is not None else json.dumps({**kept, "passed": False}))
    with caplog.at_level("WARNING", logger="quantserve"):
        ProbeCache().check(smollm2_gguf, store=store)
    assert len(counted) == 2 and "probing again" in caplog.text
    assert json.loads(path.read_text())["key"] == kept["key"]  # the next pass wrote it anew
    ProbeCache().check(smollm2_gguf, store=store)
    assert len(counted) == 2
