"""Server operations on real processes: auth, overload, cancellation, graceful SIGTERM, startup errors."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.conftest import PARIS, start_server

LONG = {
    "messages": [{"role": "user", "content": "Tell me a very long story."}],
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 0,
}


def _metric(base_url: str, name: str) -> float:
    """The served model's value (the per-model series carry a model label)."""
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_idle(base_url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Idle, every KV cell llama.cpp holds is one the scheduler knows as prefix cache: nothing leaked.
        used, cached = (
            _metric(base_url, "quantserve_kv_cells_used"),
            _metric(base_url, "quantserve_kv_cells_cached"),
        )
        if _metric(base_url, "quantserve_running_sequences") == 0 and used == cached:
            return
        time.sleep(0.2)
    raise AssertionError("sequences or KV cells still held after the client left")


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """One sequence at a time, a queue of one, and an API key."""
    srv = start_server(
        tmp_path_factory.mktemp("small"),
        "smollm2",
        "--max-num-seqs",
        "1",
        "--max-queue-len",
        "1",
        "--api-key",
        "s3cret",
    )
    yield srv
    srv.stop()


AUTH = {"Authorization": "Bearer s3cret"}


def test_api_key_is_required_and_checked(small_server):
    url = small_server.base_url + "/v1/chat/completions"
    body = {"messages": PARIS, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=body, headers=AUTH, timeout=30).status_code == 200
    for probe in ("/health", "/healthz", "/ready", "/readyz"):  # probes stay open, in both spellings
        assert httpx.get(small_server.base_url + probe).status_code == 200, probe


def test_flood_beyond_the_queue_gets_clean_503(small_server):
    url = small_server.base_url + "/v1/chat/completions"
    body = {**LONG, "max_tokens": 64}
    results: list[httpx.Response] = []

    def call():
        results.append(httpx.post(url, json=body, headers=AUTH, timeout=120))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 503}, codes
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"]
            assert r.json()["error"]["code"] == "server_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 64
    # the server is still healthy afterwards
    ok = httpx.post(url, json={"messages": PARIS, "max_tokens": 4}, headers=AUTH, timeout=60)
    assert ok.status_code == 200


def test_cancel_mid_stream_frees_kv(small_server):
    url = small_server.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**LONG, "stream": True}, headers=AUTH, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 5:
                break  # leaving the block closes the connection mid-stream
    _wait_idle(small_server.base_url)
    ok = httpx.post(
        url, json={"messages": PARIS, "max_tokens": 16, "temperature": 0}, headers=AUTH, timeout=60
    )
    assert "Paris" in ok.json()["choices"][0]["message"]["content"]


def test_disconnect_cancels_non_streaming_request(small_server):
    url = small_server.base_url + "/v1/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={**LONG, "max_tokens": 3000}, headers=AUTH, timeout=httpx.Timeout(60, read=1.0))
    _wait_idle(small_server.base_url)


def test_sigterm_lets_in_flight_stream_finish_then_exits_0(tmp_path):
    srv = start_server(tmp_path, "smollm2", "--graceful-timeout", "60")
    body = {**LONG, "max_tokens": 48, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        it = r.iter_lines()
        lines.append(next(it))
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # admission stopped
            httpx.get(srv.base_url + "/health", timeout=5)
        lines.extend(it)
    lines = [ln for ln in lines if ln]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) > 40  # every token arrived, not only the end
    assert srv.proc.wait(60) == 0


def test_sigterm_cancels_after_graceful_timeout(tmp_path):
    srv = start_server(tmp_path, "smollm2", "--graceful-timeout", "1")
    body = {**LONG, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        it = r.iter_lines()
        next(it)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.HTTPError):
            for _ in it:
                pass
    assert srv.proc.wait(60) == 0
    assert time.monotonic() - t0 < 30


def test_a_restart_finds_the_probe_passed_and_does_not_probe_again(smollm2_gguf, tmp_path):
    """The probe's pass is kept in the cache directory: a second `quantserve run` of the same GGUF, a new process,
    loads it once (not in a probe child first)."""
    logs = []
    for _ in range(2):
        srv = start_server(tmp_path, str(smollm2_gguf), "--cache-dir", str(tmp_path / "cache"))
        assert srv.stop() == 0
        logs.append(srv.log())
    assert "evaluated one token in a child process" in logs[0] and "not probed again" not in logs[0]
    assert "not probed again" in logs[1] and "evaluated one token in a child process" not in logs[1]
