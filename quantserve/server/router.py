"""ModelRouter: the models a server serves, each loaded on its first request and unloaded when room is needed.

`quantserve run MODEL` is a router of one model, loaded at startup and never unloaded. `quantserve run` with no
model (or `--models all|a,b`) serves models.toml's entries: a request for a model that is not loaded loads it
(concurrent requests share that one load), and the least recently used model unloads when `--models-max` models
are loaded or the next one would not fit (`--memory-budget`, or the memory free now). `pin = true` keeps a model
loaded; `keep_alive` unloads one that has been idle that long.

A request holds a lease on its model from `acquire` until its response has been sent (the app's LeaseMiddleware
gives it back), and a model unloads only once no lease is held: requests in flight always finish. Everything here
runs on the event loop's thread; loads and unloads run on worker threads, one load at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from quantserve.errors import InvalidRequestError, ModelLoadingError, ModelNotFoundError, QuantserveError
from quantserve.llm import LLM
from quantserve.server import memory
from quantserve.server.metrics import Metrics
from quantserve.server.served import Served

log = logging.getLogger("quantserve.server")

RETRY_FAILED_S = 10.0  # a model that failed to load answers 503 at once for this long, then loads again


def _release_memory() -> None:
    """Return freed memory to the OS, so an unload shows in the process's RSS (glibc keeps freed heap) and in the
    GPU's free memory (torch's allocator keeps freed blocks)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a daemon thread of its own: a load that is still running when the server stops (a download,
    an in-situ conversion, a probe) neither blocks the shutdown, as the default executor's threads would, nor
    outlives the process."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=f"quantserve-{getattr(fn, '__name__', 'load')}", daemon=True).start()
    return await done


class ModelRouter:
    def __init__(
        self,
        served_models: list[Served],
        metrics: Metrics,
        *,
        single: bool = False,
        default: str | None = None,
        models_max: int = 0,
        memory_budget: int = 0,
        on_load_error: Callable[[], None] | None = None,
    ):
        self.served_models = {s.name: s for s in served_models}
        self.metrics = metrics
        self.single = single  # one model, loaded at startup; requests never wait on its load
        self.default = default if default in self.served_models else None
        self.models_max = models_max
        self.memory_budget = memory_budget
        self._on_load_error = on_load_error
        self._load_lock = asyncio.Lock()  # one load (and the unloads that make room for it) at a time
        self._reaper: asyncio.Task | None = None

    # ---- finding and leasing --------------------------------------------------------------------

    def find(self, requested: str | None) -> Served:
        """The served model a request's "model" names (any case, any alias, the file name); no name: the default.

        Raises:
            ModelNotFoundError: no servable model has that name (404).
            InvalidRequestError: no name, and no default to fall back on (400).
        """
        if not requested:
            if self.single or len(self.served_models) == 1:
                return next(iter(self.served_models.values()))
            if self.default is None:
                raise InvalidRequestError(
                    f"'model' is required: this server serves {', '.join(self.served_models)}", param="model"
                )
            return self.served_models[self.default]
        low = requested.lower()
        for served in self.served_models.values():
            if low in served.names:
                return served
        if self.single:
            only = next(iter(self.served_models.values()))
            name = only.llm.name if only.llm is not None else only.name
            raise ModelNotFoundError(
                f"the model {requested!r} does not exist; this server serves {name!r}", param="model"
            )
        raise ModelNotFoundError(
            f"the model {requested!r} does not exist; this server serves {', '.join(self.served_models)} "
            "(GET /v1/models lists them)",
            param="model",
        )

    async def acquire(self, leases: list[Served], requested: str | None) -> LLM:
        """The model a request names, loaded, with a lease on it appended to `leases` (the request's own list,
        given back by `release` once the response is sent).

        Raises:
            ModelNotFoundError: no servable model has that name (404).
            InvalidRequestError: no name, and no default (400).
            ModelLoadingError: it failed to load (503, naming the cause; again at once for RETRY_FAILED_S), or,
                on a single-model server, it is still loading.
        """
        if self.single and not next(iter(self.served_models.values())).parked:
            self.single_llm()  # 503 while it loads or after it failed, whatever the name (as ever)
        served = self.find(requested)
        while True:
            if served.status == "loaded":
                served.leases += 1
                served.idle.clear()
                served.last_used = time.monotonic()
                leases.append(served)
                return served.llm
            if served.status == "unloading":
                await asyncio.shield(served.task)
                continue
            if served.task is None:
                if served.error is not None and time.monotonic() - served.failed_at < RETRY_FAILED_S:
                    raise ModelLoadingError(  # no load (and no unload to make room) per request of a broken model
                        f"model {served.name!r} failed to load: {served.error.message}",
                        code="model_load_failed",
                    )
                self._start_load(served)
            task = served.task
            served.pending += 1
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.done():
                    served.pending -= 1
                elif not task.cancelled() and task.exception() is None:
                    self._give_back(served)  # the load handed this request a lease it will not use
                raise
            except QuantserveError as exc:
                raise ModelLoadingError(
                    f"model {served.name!r} failed to load: {exc.message}", code="model_load_failed"
                ) from None
            leases.append(served)
            return served.llm

    def single_llm(self) -> LLM:
        """A single-model server's model.

        Raises:
            ModelLoadingError: it is still loading, or failed to load (503).
        """
        served = next(iter(self.served_models.values()))
        if served.llm is not None:
            return served.llm
        if served.error is not None:
            raise ModelLoadingError(
                f"the model failed to load: {served.error.message}", code="model_load_failed"
            )
        raise ModelLoadingError(
            "the model is still loading; retry shortly (GET /ready says when it is ready)"
        )

    def release(self, leases: list[Served]) -> None:
        for served in leases:
            self._give_back(served)
        leases.clear()

    def _give_back(self, served: Served) -> None:
        served.leases -= 1
        served.last_used = time.monotonic()
        if served.leases == 0:
            served.idle.set()

    # ---- loading and unloading ------------------------------------------------------------------

    def _start_load(self, served: Served) -> asyncio.Task:
        served.status, served.error = "loading", None
        served.task = asyncio.get_running_loop().create_task(self._load(served), name=f"load {served.name}")
        # a failure reaches the waiting requests; this keeps asyncio from also logging it as never retrieved
        served.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return served.task

    async def _load(self, served: Served) -> None:
        try:
            async with self._load_lock:
                try:
                    if served.resolved is None:
                        if served.setup is None:
                            raise served.error or QuantserveError(f"model {served.name!r} cannot be resolved")
                        served.resolve(await _in_thread(served.setup))
                    if served.preflight is not None:
                        await _in_thread(served.preflight)
                    await self._make_room(served)
                    t = time.perf_counter()
                    log.info("loading model %s", served.name)
                    llm = await _in_thread(LLM.load, served.resolved, served.settings, served.plan)
                except QuantserveError as exc:
                    self._failed(served, exc)
                    raise
                except Exception as exc:  # a bug, not a user error: keep the server and say what happened
                    log.exception("could not load model %s", served.name)
                    err = QuantserveError(f"{type(exc).__name__}: {exc}")
                    self._failed(served, err)
                    raise err from exc
                seconds = time.perf_counter() - t
                served.llm, served.status = llm, "loaded"
                served.names |= {llm.name.lower()}
                served.leases += (
                    served.pending
                )  # every waiting request gets its lease before anyone can unload
                served.pending = 0
                if served.leases:
                    served.idle.clear()
                served.last_used = time.monotonic()
                self.metrics.loads.labels(served.name, "ok").inc()
                self.metrics.load_seconds.labels(served.name).observe(seconds)
                self.metrics.ready.labels(served.name).set(1)
                log.info(
                    "model %s ready in %.1fs: n_ctx %d, %d sequences, backend %s",
                    llm.name,
                    seconds,
                    llm.n_ctx,
                    llm.settings.max_num_seqs,
                    llm.info.backend,
                )
        finally:
            served.task = None

    def _failed(self, served: Served, exc: QuantserveError) -> None:
        served.status, served.error, served.pending, served.failed_at = "unloaded", exc, 0, time.monotonic()
        self.metrics.loads.labels(served.name, "error").inc()
        log.error("could not load model %s: %s", served.name, exc.message)
        if self._on_load_error is not None:
            self._on_load_error()

    async def _make_room(self, target: Served) -> None:
        """Unload least-recently-used models (idle ones first) until `target` may load: fewer than --models-max
        loaded, its estimate within --memory-budget beside theirs, and within the memory free now."""
        if self.memory_budget and target.estimate > self.memory_budget:
            raise ModelLoadingError(
                f"cannot load {target.name}: it needs ~{target.estimate / 2**20:.0f} MiB (weights plus KV), more "
                f"than --memory-budget {self.memory_budget / 2**20:.0f} MiB on its own; raise the budget or lower "
                "--ctx-size / --max-num-seqs",
                code="model_load_failed",
            )
        while True:
            unloading = [s.task for s in self.served_models.values() if s.status == "unloading"]
            if unloading:  # their memory is not free yet
                await asyncio.gather(*(asyncio.shield(t) for t in unloading))
                continue
            loaded = [s for s in self.served_models.values() if s.status == "loaded"]
            why, hard = None, True
            if self.models_max and len(loaded) >= self.models_max:
                why = f"--models-max {self.models_max} models are loaded"
            elif (
                self.memory_budget and sum(s.estimate for s in loaded) + target.estimate > self.memory_budget
            ):
                why = (
                    f"{target.name} (~{target.estimate / 2**20:.0f} MiB) beside the loaded models would pass "
                    f"--memory-budget {self.memory_budget / 2**20:.0f} MiB"
                )
            else:
                free = memory.free_bytes(target.facts.get("backend", "llamacpp"))
                if free is not None and target.estimate > free:
                    why, hard = (
                        f"{target.name} needs ~{target.estimate / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free",
                        False,
                    )
            if why is None:
                return
            victims = [s for s in loaded if not s.pinned]
            if not victims:
                if not hard:  # the estimate may be pessimistic (mmap'ed weights are page cache): try
                    log.warning("%s, and no loaded model can be unloaded; loading it anyway", why)
                    return
                raise ModelLoadingError(
                    f"cannot load {target.name}: {why}, and all of them are pinned; raise the limit or unpin one",
                    code="model_load_failed",
                )
            victim = min(victims, key=lambda s: (s.leases > 0, s.last_used))
            log.info("unloading %s to make room for %s: %s", victim.name, target.name, why)
            await asyncio.shield(self.start_unload(victim, "lru"))

    def start_unload(self, served: Served, reason: str) -> asyncio.Task:
        """Unload `served` once its in-flight requests have finished; new requests for it wait, then reload it."""
        if served.status == "unloading":
            return served.task
        served.status = "unloading"
        served.task = asyncio.get_running_loop().create_task(
            self._unload(served, reason), name=f"unload {served.name}"
        )
        return served.task

    async def _unload(self, served: Served, reason: str) -> None:
        try:
            if not served.idle.is_set():
                log.info(
                    "model %s: waiting for %d request(s) in flight before unloading",
                    served.name,
                    served.leases,
                )
            await served.idle.wait()
            llm, served.llm = served.llm, None
            if self.single and served.plan is None:  # a router-mode model has its plan from before it loaded
                served.set_plan(llm.plan)  # /v1/models still says what it is
            t = time.perf_counter()
            await _in_thread(llm.close)
            del llm
            await _in_thread(_release_memory)
            self.metrics.unloads.labels(served.name, reason).inc()
            self.metrics.ready.labels(served.name).set(0)
            log.info("model %s unloaded (%s) in %.1fs", served.name, reason, time.perf_counter() - t)
        finally:
            served.status, served.task = "unloaded", None

    def can_unload_on_request(self, served: Served) -> bool:
        """Whether a client may unload `served` (Ollama's keep_alive): not a pinned models.toml entry, nor a model
        handed to the app already loaded (nothing could load it again)."""
        return served.resolved is not None and (self.single or not served.pinned)

    def unload_on_request(self, served: Served, reason: str) -> bool:
        """Unload `served` once its requests in flight finish, as a client asked; the next request for it loads
        it again (on a single-model server too). Returns False where can_unload_on_request says no."""
        if not self.can_unload_on_request(served) or served.status not in ("loaded", "unloading"):
            return False
        served.parked = True
        self.start_unload(served, reason)
        return True

    def set_keep_alive(self, served: Served, seconds: float | None) -> None:
        """A client's keep_alive: `served` unloads once idle that long (None: never), until another says else."""
        if not self.can_unload_on_request(served):
            return
        served.keep_alive = seconds
        if seconds is not None:
            served.parked = True
            if self._reaper is None:
                self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="keep_alive")

    async def unload(self, requested: str) -> Served:
        """Admin unload (POST /models/unload): after the requests in flight on it.

        Raises:
            InvalidRequestError: the model is pinned.
        """
        served = self.find(requested)
        if served.pinned:
            raise InvalidRequestError(
                f"model {served.name!r} is pinned (models.toml pin = true); it stays loaded"
            )
        if served.status == "loading" and served.task is not None:
            with contextlib.suppress(
                QuantserveError
            ):  # a failed load leaves it unloaded, which is what was asked
                await asyncio.shield(served.task)
        if served.status in ("loaded", "unloading"):
            await asyncio.shield(self.start_unload(served, "request"))
        return served

    # ---- lifetime -------------------------------------------------------------------------------

    def start(self) -> None:
        """Load pinned models (a single-model server's one model) now, and start the keep_alive reaper."""
        for served in self.served_models.values():
            if served.pinned and served.status == "unloaded" and served.task is None:
                self._start_load(served)
        if any(s.keep_alive is not None for s in self.served_models.values()):
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="keep_alive")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for served in self.served_models.values():
                # pinned: never, but a single-model server's model once a client has set its keep_alive
                if (
                    served.status == "loaded"
                    and (not served.pinned or served.parked)
                    and served.keep_alive is not None
                    and served.leases == 0
                    and now - served.last_used >= served.keep_alive
                ):
                    log.info("model %s idle for %.0fs (keep_alive)", served.name, now - served.last_used)
                    self.start_unload(served, "keep_alive")

    def stop(self) -> list[LLM]:
        """On the event loop, at shutdown: stop unloading by idleness and take every loaded model (to close on a
        worker thread). A load still running then finishes unseen; the process exits around it."""
        if self._reaper is not None:
            self._reaper.cancel()
        llms = [s.llm for s in self.served_models.values() if s.llm is not None]
        for served in self.served_models.values():
            served.llm, served.status = None, "unloaded"
        return llms

    def loaded(self) -> list[tuple[str, LLM]]:
        return [(s.name, s.llm) for s in self.served_models.values() if s.llm is not None]
