"""ModelRouter's bookkeeping with a stand-in for LLM.load (the real loads are in test_router.py): one load for
concurrent first requests, LRU order with idle models first, pins, waiting for leases, keep_alive, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from quantserve.core.settings import EngineSettings
from quantserve.errors import InvalidRequestError, ModelFileError, ModelLoadingError, ModelNotFoundError
from quantserve.registry import ModelEntry, ResolvedModel
from quantserve.server.metrics import Metrics
from quantserve.server.router import ModelRouter
from quantserve.server.served import Served


class FakeLLM:
    def __init__(self, name: str):
        self.name, self.closed = name, False
        self.n_ctx, self.settings = 64, EngineSettings()
        self.info = type("Info", (), {"backend": "fake"})()
        self.plan = type("Plan", (), {"memory_bytes": 0, "n_ctx": 64})()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def loads(monkeypatch):
    """Every LLM.load call's model name; a name starting with "bad" fails, one with "slow" takes 0.3 s."""
    calls: list[str] = []
    lock = threading.Lock()

    def load(resolved, settings, plan=None):
        with lock:
            calls.append(resolved.name)
        time.sleep(0.3 if resolved.name.startswith("slow") else 0.01)
        if resolved.name.startswith("bad"):
            raise ModelFileError(f"{resolved.name}.gguf is truncated")
        return FakeLLM(resolved.name)

    monkeypatch.setattr("quantserve.server.router.LLM.load", load)
    return calls


def _served(name: str, **kw) -> Served:
    resolved = ResolvedModel(name, Path(f"/models/{name}.gguf"), ModelEntry(source=name))
    return Served(name, resolved, EngineSettings(), names=frozenset({name}), **kw)


def _router(*served_models: Served, **kw) -> ModelRouter:
    return ModelRouter(list(served_models), Metrics(), **kw)


def test_concurrent_first_requests_share_one_load(loads):
    async def main():
        r = _router(_served("slow-a"))
        leases: list = []
        got = await asyncio.gather(*(r.acquire(leases, "slow-a") for _ in range(8)))
        assert len({id(x) for x in got}) == 1 and r.served_models["slow-a"].leases == 8
        r.release(leases)
        assert r.served_models["slow-a"].leases == 0 and r.served_models["slow-a"].idle.is_set()

    asyncio.run(main())
    assert loads == ["slow-a"]


def test_lru_unloads_the_least_recently_used_idle_model_and_never_a_pinned_one(loads):
    async def main():
        r = _router(_served("p", pinned=True), _served("a"), _served("b"), models_max=2)
        r.start()  # loads the pinned one
        await asyncio.sleep(0.1)
        assert r.served_models["p"].status == "loaded"
        held: list = []
        a = await r.acquire(held, "a")  # room: p + a
        assert r.served_models["a"].status == "loaded"
        r.release(held)
        await r.acquire(held, "b")  # p is pinned: a goes
        r.release(held)
        assert (r.served_models["a"].status, r.served_models["b"].status, r.served_models["p"].status) == (
            "unloaded",
            "loaded",
            "loaded",
        )
        assert a.closed

    asyncio.run(main())
    assert loads == ["p", "a", "b"]


def test_a_model_in_use_unloads_only_after_its_requests_finish(loads):
    async def main():
        r = _router(_served("a"), _served("b"), models_max=1)
        held_a: list = []
        a = await r.acquire(held_a, "a")
        b_task = asyncio.create_task(r.acquire([], "b"))
        await asyncio.sleep(0.2)
        assert not a.closed and r.served_models["a"].status == "unloading" and not b_task.done()
        # a new request for "a" waits for the unload (and would then load it again)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.acquire([], "a"), 0.05)
        r.release(held_a)  # the request in flight ends
        await asyncio.wait_for(b_task, 5)
        assert a.closed and r.served_models["b"].status == "loaded"

    asyncio.run(main())


def test_idle_models_go_before_busy_ones(loads):
    async def main():
        r = _router(_served("a"), _served("b"), _served("c"), models_max=2)
        busy: list = []
        await r.acquire(busy, "a")  # oldest, but in use
        held: list = []
        await r.acquire(held, "b")
        r.release(held)
        await r.acquire(held, "c")
        assert (r.served_models["a"].status, r.served_models["b"].status) == ("loaded", "unloaded")

    asyncio.run(main())


def test_memory_budget_unloads_until_the_next_model_fits(loads, monkeypatch):
    monkeypatch.setattr("quantserve.server.memory.free_bytes", lambda backend: None)

    async def main():
        mib = 2**20
        r = _router(
            _served("a", estimate=400 * mib), _served("b", estimate=400 * mib), _served("c", estimate=500 * mib),
            memory_budget=1000 * mib,
        )  # fmt: skip
        held: list = []
        for name in ("a", "b"):
            await r.acquire(held, name)
            r.release(held)
        await r.acquire(held, "c")  # 400 + 400 + 500 > 1000: a (least recently used) goes, b stays
        assert [s.status for s in r.served_models.values()] == ["unloaded", "loaded", "loaded"]

    asyncio.run(main())


def test_all_pinned_refuses_with_the_reason(loads):
    async def main():
        r = _router(_served("p", pinned=True), _served("a"), models_max=1)
        r.start()
        await asyncio.sleep(0.1)
        with pytest.raises(ModelLoadingError, match="models-max 1.*pinned"):
            await r.acquire([], "a")
        with pytest.raises(InvalidRequestError, match="pinned"):
            await r.unload("p")

    asyncio.run(main())


def test_a_failed_load_answers_each_waiter_with_the_cause_and_is_retried_later(loads, monkeypatch):
    async def main():
        r = _router(_served("bad"), _served("ok"))
        results = await asyncio.gather(*(r.acquire([], "bad") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(e, ModelLoadingError) and "truncated" in e.message for e in results)
        assert results[0].http_status == 503 and results[0].code == "model_load_failed"
        assert (
            r.served_models["bad"].status == "unloaded"
            and "truncated" in r.served_models["bad"].error.message
        )
        assert await r.acquire([], "ok")
        with pytest.raises(ModelLoadingError, match="truncated"):  # at once, no load: the failure is fresh
            await r.acquire([], "bad")
        assert loads == ["bad", "ok"]
        monkeypatch.setattr("quantserve.server.router.RETRY_FAILED_S", 0.0)
        with pytest.raises(
            ModelLoadingError, match="truncated"
        ):  # later: loaded again (a fixed file would load)
            await r.acquire([], "bad")

    asyncio.run(main())
    assert loads == ["bad", "ok", "bad"]  # one load for the three concurrent requests, one for the retry


def test_a_model_over_the_whole_budget_is_refused_without_unloading_anything(loads, monkeypatch):
    monkeypatch.setattr("quantserve.server.memory.free_bytes", lambda backend: None)

    async def main():
        r = _router(_served("a", estimate=2**20), _served("big", estimate=2**31), memory_budget=2**30)
        await r.acquire([], "a")
        with pytest.raises(ModelLoadingError, match="more than --memory-budget 1024 MiB on its own"):
            await r.acquire([], "big")
        assert r.served_models["a"].status == "loaded"

    asyncio.run(main())


def test_keep_alive_unloads_an_idle_model(loads):
    async def main():
        r = _router(_served("a", keep_alive=0.5), _served("b"))
        r.start()
        held: list = []
        await r.acquire(held, "a")
        await r.acquire(held, "b")
        await asyncio.sleep(1.8)
        assert r.served_models["a"].status == "loaded"  # in use: never idled out
        r.release(held)
        for _ in range(100):  # idle past keep_alive, then through "unloading" (a busy machine takes its time)
            await asyncio.sleep(0.1)
            if r.served_models["a"].status == "unloaded":
                break
        assert (r.served_models["a"].status, r.served_models["b"].status) == ("unloaded", "loaded")
        r.stop()

    asyncio.run(main())


def test_a_cancelled_waiter_gives_its_lease_back(loads):
    async def main():
        r = _router(_served("slow-a"))
        waiter = asyncio.create_task(r.acquire([], "slow-a"))
        await asyncio.sleep(0.05)
        waiter.cancel()  # the client left during the load
        await asyncio.sleep(0.5)
        served = r.served_models["slow-a"]
        assert (
            served.status == "loaded" and served.leases == 0 and served.pending == 0 and served.idle.is_set()
        )

    asyncio.run(main())


def test_names_any_case_aliases_and_a_default(loads):
    r = _router(_served("a"), _served("b"), default="b")
    assert r.find("A").name == "a" and r.find(None).name == "b"
    with pytest.raises(ModelNotFoundError, match="serves a, b"):
        r.find("c")
    with pytest.raises(InvalidRequestError, match="'model' is required"):
        _router(_served("a"), _served("b")).find(None)


def test_the_kv_estimate_reads_per_layer_head_counts(smollm2_gguf, tmp_path):
    """llama.cpp allows head_count_kv as a per-layer array (OpenELM, Nemotron-NAS): summed, not repeated."""
    from quantserve.backends.select import plan_model
    from quantserve.core.model_size import model_shape
    from quantserve.formats import detect
    from tests.fixtures.gguf_mutants import PASSING, write_mutant

    per_layer = tmp_path / "per-layer.gguf"
    write_mutant(smollm2_gguf, per_layer, PASSING[0])  # 29 layers with 3 KV heads, the last with 1
    plain, mutant = model_shape(detect(smollm2_gguf)), model_shape(detect(per_layer))
    assert (plain.kv_heads, mutant.kv_heads) == (30 * 3, 29 * 3 + 1)
    settings = EngineSettings(ctx_size=1024, max_num_seqs=2)
    plan = plan_model(detect(smollm2_gguf), settings)
    assert (
        plan.memory_bytes - plan.weight_bytes == 2 * 90 * 64 * 2048 * 2
    )  # K and V, 90 heads of 64, 2048 cells
    assert plan.weight_bytes == smollm2_gguf.stat().st_size
    assert plan_model(detect(per_layer), settings).kv.bytes == 2 * 88 * 64 * 2048 * 2


def test_a_client_unload_waits_for_the_request_and_a_single_model_server_loads_again(loads, monkeypatch):
    """Ollama's keep_alive 0: the model unloads once the asking request is done; a single-model server, which
    otherwise answers 503 while its model is not loaded, loads it on the next request. A pinned models.toml entry
    stays, and so does a model handed over already loaded (nothing could load it again)."""
    monkeypatch.setattr("quantserve.server.served.plan_facts", lambda plan: {"context_length": plan.n_ctx})

    async def main():
        r = _router(_served("one", pinned=True), single=True)
        r.start()
        await asyncio.sleep(0.1)
        held: list = []
        first = await r.acquire(held, "one")
        served = r.served_models["one"]
        assert r.unload_on_request(served, "keep_alive=0")
        await asyncio.sleep(0.05)
        assert served.status == "unloading" and not first.closed  # the request still holds it
        r.release(held)
        await asyncio.wait_for(asyncio.shield(served.task), 5)
        assert first.closed and served.status == "unloaded" and served.facts == {"context_length": 64}
        again = await r.acquire(held, "one")
        assert again is not first and served.status == "loaded"
        r.release(held)
        # a client's keep_alive duration: the reaper unloads it once idle that long
        r.set_keep_alive(served, 0.2)
        for _ in range(40):
            await asyncio.sleep(0.1)
            if served.status == "unloaded":
                break
        assert again.closed and served.status == "unloaded"
        await r.acquire(held, "one")
        r.release(held)
        r.stop()

        pinned = _router(_served("p", pinned=True), _served("a"))
        pinned.start()
        await asyncio.sleep(0.1)
        assert not pinned.unload_on_request(pinned.served_models["p"], "keep_alive=0")
        given = Served("g", None, EngineSettings(), pinned=True, names=frozenset({"g"}))
        given.llm, given.status = FakeLLM("g"), "loaded"
        assert not _router(given, single=True).unload_on_request(given, "keep_alive=0")

    asyncio.run(main())
    assert loads == ["one", "one", "one", "p"]


@pytest.mark.parametrize(
    "value, seconds",
    [(0, 0.0), ("0", 0.0), ("0s", 0.0), (300, 300.0), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0),
     ("1.5h", 5400.0), ("250ms", 0.25), (-1, None), ("-1m", None), (None, None)],
)  # fmt: skip
def test_ollama_keep_alive_durations(value, seconds):
    from quantserve.server.ollama.protocol import keep_alive_seconds

    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", "", "m", True])
def test_ollama_keep_alive_refuses_what_is_no_duration(value):
    from quantserve.errors import InvalidRequestError
    from quantserve.server.ollama.protocol import keep_alive_seconds

    with pytest.raises(InvalidRequestError, match="keep_alive"):
        keep_alive_seconds(value)
