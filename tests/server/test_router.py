"""Router mode against real `quantserve run` processes: three forms of SmolLM2 from one models.toml (its Q4_1
GGUF, a q8_0 conversion, the HF directory on the torch backend), each loaded on its first request; --models-max
unloading the least recently used (the process's RSS drops); concurrent first requests sharing one load; broken
models (one our validator refuses, one that passes it and makes llama.cpp abort) answering 503 while the others
serve; requests in flight finishing before their model unloads; keep_alive; the admin routes."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import PARIS, start_server
from tests.fixtures.gguf_mutants import write_aborting_gguf

KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _ask(base_url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": PARIS, "temperature": 0, "max_tokens": 24, **extra}
    return httpx.post(base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)


def _models(base_url: str) -> dict[str, dict]:
    cards = httpx.get(base_url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    return {c["id"]: c for c in cards}


def _metric(base_url: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"(\w+)\{(.*)\} (\S+)$", line)
        if m and m[1] == name and ",".join(sorted(m[2].split(","))) == want:
            return float(m[3])
    return 0.0


@pytest.fixture(scope="module")
def models_toml(smollm2_gguf, smollm2_hf, tmp_path_factory) -> Path:
    from quantserve.gguf.hf_to_gguf import hf_to_gguf

    d = tmp_path_factory.mktemp("router")
    q8 = hf_to_gguf(smollm2_hf, d / "smollm2-q8_0.gguf", quant="q8_0", progress=False)
    corrupt = d / "corrupt.gguf"
    corrupt.write_bytes(smollm2_gguf.read_bytes()[:5_000_000])  # cut inside the tensor data
    aborts = d / "aborts.gguf"
    how = write_aborting_gguf(smollm2_gguf, aborts)
    (d / "how-it-aborts.txt").write_text(how)
    toml = d / "models.toml"
    toml.write_text(
        f"""default = "smollm2"
[models.smollm2]
source = "{smollm2_gguf}"
ctx_size = 1024
[models.smollm2-q8]
source = "{q8}"
ctx_size = 1024
[models.smollm2-torch]
source = "{smollm2_hf}"
backend = "torch"
ctx_size = 1024
[models.corrupt]
source = "{corrupt}"
[models.aborts]
source = "{aborts}"
"""
    )
    return toml


@pytest.fixture(scope="module")
def router(models_toml, tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("router-log"),
        "--models-file", str(models_toml), "--models-max", "2", "--max-num-seqs", "2", "--api-key", KEY,
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


def test_router_is_ready_at_once_and_lists_every_model_unloaded(router):
    ready = httpx.get(router.base_url + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    cards = _models(router.base_url)
    assert set(cards) == {"smollm2", "smollm2-q8", "smollm2-torch", "corrupt", "aborts"}
    assert all(c["status"] == "unloaded" for c in cards.values())
    torch_card = cards["smollm2-torch"]
    assert torch_card["meta"]["backend"] == "torch" and torch_card["context_length"] == 1024
    assert "chat" in torch_card["capabilities"] and cards["smollm2"]["meta"]["backend"] == "llamacpp"
    assert "truncated" in cards["corrupt"]["error"]  # found at startup, from the header alone
    assert httpx.get(router.base_url + "/v1/models", timeout=10).status_code == 401  # the key guards it


def test_three_models_answer_and_the_third_unloads_the_least_recently_used(router):
    assert "Paris" in _ask(router.base_url, "smollm2-torch").json()["choices"][0]["message"]["content"]
    assert "Paris" in _ask(router.base_url, "smollm2").json()["choices"][0]["message"]["content"]
    statuses = {k: c["status"] for k, c in _models(router.base_url).items()}
    assert statuses["smollm2-torch"] == statuses["smollm2"] == "loaded"
    before = _rss_mib(router.proc.pid)
    r = _ask(router.base_url, "smollm2-q8")  # --models-max 2: the torch model (least recently used) goes
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    after = _rss_mib(router.proc.pid)
    statuses = {k: c["status"] for k, c in _models(router.base_url).items()}
    assert (statuses["smollm2-torch"], statuses["smollm2"], statuses["smollm2-q8"]) == (
        "unloaded", "loaded", "loaded",
    )  # fmt: skip
    assert (
        _metric(router.base_url, "quantserve_model_unloads_total", model="smollm2-torch", reason="lru") == 1
    )
    # The fp32 torch model (~540 MB of weights) left; the q8_0 GGUF (~145 MB, mmap'ed) came in.
    print(f"RSS with torch + Q4_1 loaded: {before:.0f} MiB; after the q8_0 request: {after:.0f} MiB")
    assert after < before - 200, (before, after)
    assert "model smollm2-torch unloaded (lru)" in router.log()


def test_eight_concurrent_first_requests_trigger_one_load(router):
    if _models(router.base_url)["smollm2-torch"]["status"] == "loaded":  # run alone: make it unloaded first
        httpx.post(
            router.base_url + "/models/unload", json={"model": "smollm2-torch"}, headers=AUTH, timeout=300
        )
    before = _metric(router.base_url, "quantserve_model_loads_total", model="smollm2-torch", outcome="ok")
    loads_logged = router.log().count("loading model smollm2-torch")
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: _ask(router.base_url, "smollm2-torch", max_tokens=4), range(8)))
    assert [r.status_code for r in replies] == [200] * 8
    after = _metric(router.base_url, "quantserve_model_loads_total", model="smollm2-torch", outcome="ok")
    assert after - before == 1
    assert router.log().count("loading model smollm2-torch") == loads_logged + 1


def test_broken_models_answer_503_with_the_cause_while_the_others_serve(router, models_toml):
    for name in ("smollm2", "smollm2-q8"):  # --models-max 2 reached: a load now would unload one first
        assert _ask(router.base_url, name, max_tokens=1).status_code == 200
    loaded = {k for k, c in _models(router.base_url).items() if c["status"] == "loaded"}
    r = _ask(router.base_url, "corrupt")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    assert "truncated" in r.json()["error"]["message"]
    r = _ask(router.base_url, "aborts")  # passes our validator; llama.cpp aborts on it, in the probe's child
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "aborts" in message and "SIG" in message, message
    assert router.proc.poll() is None  # the server lives
    # the probe ran before anything unloaded to make room: the broken models cost no working one its place
    assert {k for k, c in _models(router.base_url).items() if c["status"] == "loaded"} == loaded
    assert _ask(router.base_url, "smollm2").status_code == 200
    assert httpx.get(router.base_url + "/ready", timeout=10).status_code == 200
    cards = _models(router.base_url)
    assert "SIG" in cards["aborts"]["error"] and cards["aborts"]["status"] == "unloaded"


def test_admin_routes_need_the_key_and_load_and_unload(router):
    assert (
        httpx.post(router.base_url + "/models/load", json={"model": "smollm2"}, timeout=30).status_code == 401
    )
    r = httpx.post(router.base_url + "/models/load", json={"model": "nope"}, headers=AUTH, timeout=30)
    assert r.status_code == 404 and "smollm2-q8" in r.json()["error"]["message"]
    r = httpx.post(router.base_url + "/models/load", json={"model": "smollm2-q8"}, headers=AUTH, timeout=300)
    assert r.status_code == 200 and r.json()["status"] == "loaded"
    r = httpx.post(
        router.base_url + "/models/unload", json={"model": "smollm2-q8"}, headers=AUTH, timeout=300
    )
    assert r.status_code == 200 and r.json()["status"] == "unloaded"
    r = httpx.post(router.base_url + "/models/unload", json={"name": "x"}, headers=AUTH, timeout=30)
    assert r.status_code == 400


@pytest.fixture(scope="module")
def one_at_a_time(models_toml, tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("router1-log"),
        "--models-file", str(models_toml), "--models", "smollm2,smollm2-q8", "--models-max", "1",
        "--keep-alive", "3",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


def test_a_request_in_flight_finishes_before_its_model_unloads(one_at_a_time):
    base = one_at_a_time.base_url
    assert set(_models(base)) == {"smollm2", "smollm2-q8"}  # --models picks entries
    chunks: list[dict] = []
    first = threading.Event()
    ended_at: list[float] = []

    def stream() -> None:
        body = {
            "model": "smollm2",
            "prompt": "1, 2, 3,",
            "max_tokens": 160,
            "ignore_eos": True,
            "temperature": 0,  # greedy: a sampled end token (ignored, printing nothing) would send no chunk
            "stream": True,
        }
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()
        ended_at.append(time.monotonic())

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(120)
    r = _ask(base, "smollm2-q8")  # --models-max 1: smollm2 must go, but only after the stream ends
    answered_at = time.monotonic()
    t.join(300)
    assert r.status_code == 200
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) >= 150  # every token arrived
    assert ended_at[0] <= answered_at
    log = one_at_a_time.log()
    assert "waiting for 1 request(s) in flight before unloading" in log
    assert "model smollm2 unloaded (lru)" in log


def test_keep_alive_unloads_an_idle_model(one_at_a_time):
    base = one_at_a_time.base_url
    assert _ask(base, "smollm2-q8").status_code == 200
    deadline = time.monotonic() + 30
    while _models(base)["smollm2-q8"]["status"] != "unloaded":
        assert time.monotonic() < deadline, "not unloaded after 30 s idle with --keep-alive 3"
        time.sleep(0.5)
    assert _metric(base, "quantserve_model_unloads_total", model="smollm2-q8", reason="keep_alive") >= 1


def test_unknown_model_names_and_stray_router_flags_are_refused_before_listening(models_toml):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "quantserve.cli", "run", "--models-file", str(models_toml), "--models", "x,smollm2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--models 'x': no such entry" in r.stderr and "smollm2-q8" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "quantserve.cli", "run", "smollm2", "--models-max", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--models-max: for router mode only" in r.stderr
