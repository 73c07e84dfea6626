"""The in-situ cache key follows content, quant and version; entries commit atomically and can be removed."""

from __future__ import annotations

import os

from quantserve.insitu.cache import QuantCache


def _src(tmp_path, weights: bytes = b"w" * 1000):
    d = tmp_path / "src"
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_text('{"model_type": "llama"}')
    return [d / "model.safetensors", d / "config.json"]


def test_key_depends_on_content_and_quant_not_on_mtime(tmp_path):
    qc = QuantCache(tmp_path / "cache")
    files = _src(tmp_path)
    k = qc.key(files, "q4_k_m")
    assert qc.key(files, "Q4_K_M") == k
    assert qc.key(files, "q8_0") != k
    os.utime(files[0], (1, 1))  # touched, same bytes: same key (digest recomputed, memo keyed by mtime)
    assert qc.key(files, "q4_k_m") == k
    files[0].write_bytes(b"x" * 1000)  # same size, new content
    assert qc.key(files, "q4_k_m") != k


def test_entry_exists_only_after_commit_and_can_be_removed(tmp_path):
    qc = QuantCache(tmp_path / "cache")
    key = qc.key(_src(tmp_path), "q8_0")
    out = qc.store_dir(key) / "model.gguf"
    out.write_bytes(b"GGUF" + b"\0" * 100)
    assert qc.lookup(key) is None  # half-written conversions are invisible
    entry = qc.commit(key, out, tmp_path / "src", "q8_0")
    assert qc.lookup(key) == entry and entry.path == out and entry.size >= 104
    assert [e.key for e in qc.entries()] == [key]
    assert qc.remove(key) and qc.lookup(key) is None and qc.entries() == []
    assert not qc.remove("../../etc")


def test_hub_blobs_are_not_reread(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    blob = blobs / ("a" * 64)
    blob.write_bytes(b"data")
    link = tmp_path / "model.safetensors"
    link.symlink_to(blob)
    qc = QuantCache(tmp_path / "cache")
    qc.key([link], "q4_0")
    assert not (tmp_path / "cache" / "digests").exists()  # named by its sha256 already
