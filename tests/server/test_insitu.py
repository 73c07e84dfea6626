"""In-situ quantization: the HF form of SmolLM2 served through the OpenAI server, quantized at load and cached."""

from __future__ import annotations

import httpx

from tests.conftest import PARIS, start_server, together

# Measured: re-quantizing SmolLM2 (itself a Q4_1 file) to the K-quant mixes q4_k_m / q5_k_m loses this answer
# (it answers in French, like the model does without a system prompt), while q8_0, q6_k and q4_1 keep it. So the
# Paris check runs on q8_0, and the q4_k_m run checks the conversion, the mix and the cache.


def _ask(base_url: str) -> str:
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 24}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0][
        "message"
    ]["content"]


def test_run_hf_dir_quantizes_at_load_then_reuses_the_cache(smollm2_hf, tmp_path):
    """Two servers started at once on a cold cache: one converts, the other waits on the entry's lock and serves
    the result; a third start by path finds it cached."""
    cache = tmp_path / "cache"
    models = tmp_path / "models.toml"
    models.write_text(f'[models.smol-hf]\nsource = "{smollm2_hf}"\nquant = "q4_k_m"\n')
    args = ("smol-hf", "--models-file", str(models), "--cache-dir", str(cache))
    servers = together(lambda: start_server(tmp_path, *args), lambda: start_server(tmp_path, *args))
    try:
        for srv in servers:
            assert _ask(srv.base_url).strip()
    finally:
        assert [srv.stop() for srv in servers] == [0, 0]
    logs = [srv.log() for srv in servers]
    assert sum("in-situ quantization of" in log for log in logs) == 1, logs  # one conversion
    assert sum("another process is converting" in log for log in logs) == 1, logs
    assert all("after conversion to GGUF (q4_k_m)" in log for log in logs)
    assert sum("cached as" in log for log in logs) == 1 and sum("cache hit" in log for log in logs) == 1
    cached = list(cache.glob("*/model.gguf"))
    assert len(cached) == 1

    from quantserve.formats import read_gguf_info

    types = {t.type_name for t in read_gguf_info(cached[0]).tensors}
    assert "Q4_K" in types  # a real Q4_K_M mix, not a copy of the source

    # The same source by path with --quant: same content, same key, no conversion.
    srv = start_server(tmp_path, str(smollm2_hf), "--quant", "Q4_K_M", "--cache-dir", str(cache))
    try:
        assert _ask(srv.base_url).strip()
    finally:
        srv.stop()
    assert "cache hit" in srv.log() and "cached as" not in srv.log()


def test_in_situ_q8_0_answers_paris_through_the_server(smollm2_hf, tmp_path):
    """The HF form of SmolLM2, quantized at load, served, asked the Paris question (--no-cache: a temp dir)."""
    cache = tmp_path / "cache"
    srv = start_server(tmp_path, str(smollm2_hf), "--quant", "q8_0", "--no-cache", "--cache-dir", str(cache))
    try:
        assert "Paris" in _ask(srv.base_url)
    finally:
        srv.stop()
    assert not cache.exists() or not list(cache.glob("*/model.gguf"))
