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
from quantserve.server.slot import Slot

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
        slots: list[Slot],
        metrics: Metrics,
        *,
        single: bool = False,
        default: str | None = None,
        models_max: int = 0,
        memory_budget: int = 0,
        on_load_error: Callable[[], None] | None = None,
    ):
        self.slots = {s.name: s for s in slots}
        self.metrics = metrics
        self.single = single  # one model, loaded at startup; requests never wait on its load
        self.default = default if default in self.slots else None
        self.models_max = models_max
        self.memory_budget = memory_budget
        self._on_load_error = on_load_error
        self._load_lock = asyncio.Lock()  # one load (and the unloads that make room for it) at a time
        self._reaper: asyncio.Task | None = None

    # ---- finding and leasing --------------------------------------------------------------------

    def find(self, requested: str | None) -> Slot:
        """The slot a request's "model" names (any case, any alias, the file name); no name: the default.

        Raises:
            ModelNotFoundError: no servable model has that name (404).
            InvalidRequestError: no name, and no default to fall back on (400).
        """
        if not requested:
            if self.single or len(self.slots) == 1:
                return next(iter(self.slots.values()))
            if self.default is None:
                raise InvalidRequestError(
                    f"'model' is required: this server serves {', '.join(self.slots)}", param="model"
                )
            return self.slots[self.default]
        low = requested.lower()
        for slot in self.slots.values():
            if low in slot.names:
                return slot
        if self.single:
            only = next(iter(self.slots.values()))
            served = only.llm.name if only.llm is not None else only.name
            raise ModelNotFoundError(
                f"the model {requested!r} does not exist; this server serves {served!r}", param="model"
            )
        raise ModelNotFoundError(
            f"the model {requested!r} does not exist; this server serves {', '.join(self.slots)} "
            "(GET /v1/models lists them)",
            param="model",
        )

    async def acquire(self, leases: list[Slot], requested: str | None) -> LLM:
        """The model a request names, loaded, with a lease on it appended to `leases` (the request's own list,
        given back by `release` once the response is sent).

        Raises:
            ModelNotFoundError: no servable model has that name (404).
            InvalidRequestError: no name, and no default (400).
            ModelLoadingError: it failed to load (503, naming the cause; again at once for RETRY_FAILED_S), or,
                on a single-model server, it is still loading.
        """
        if self.single and not next(iter(self.slots.values())).parked:
            self.single_llm()  # 503 while it loads or after it failed, whatever the name (as ever)
        slot = self.find(requested)
        while True:
            if slot.status == "loaded":
                slot.leases += 1
                slot.idle.clear()
                slot.last_used = time.monotonic()
                leases.append(slot)
                return slot.llm
            if slot.status == "unloading":
                await asyncio.shield(slot.task)
                continue
            if slot.task is None:
                if slot.error is not None and time.monotonic() - slot.failed_at < RETRY_FAILED_S:
                    raise ModelLoadingError(  # no load (and no unload to make room) per request of a broken model
                        f"model {slot.name!r} failed to load: {slot.error.message}", code="model_load_failed"
                    )
                self._start_load(slot)
            task = slot.task
            slot.pending += 1
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.done():
                    slot.pending -= 1
                elif not task.cancelled() and task.exception() is None:
                    self._give_back(slot)  # the load handed this request a lease it will not use
                raise
            except QuantserveError as exc:
                raise ModelLoadingError(
                    f"model {slot.name!r} failed to load: {exc.message}", code="model_load_failed"
                ) from None
            leases.append(slot)
            return slot.llm

    def single_llm(self) -> LLM:
        """A single-model server's model.

        Raises:
            ModelLoadingError: it is still loading, or failed to load (503).
        """
        slot = next(iter(self.slots.values()))
        if slot.llm is not None:
            return slot.llm
        if slot.error is not None:
            raise ModelLoadingError(
                f"the model failed to load: {slot.error.message}", code="model_load_failed"
            )
        raise ModelLoadingError(
            "the model is still loading; retry shortly (GET /ready says when it is ready)"
        )

    def release(self, leases: list[Slot]) -> None:
        for slot in leases:
            self._give_back(slot)
        leases.clear()

    def _give_back(self, slot: Slot) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()
        if slot.leases == 0:
            slot.idle.set()

    # ---- loading and unloading ------------------------------------------------------------------

    def _start_load(self, slot: Slot) -> asyncio.Task:
        slot.status, slot.error = "loading", None
        slot.task = asyncio.get_running_loop().create_task(self._load(slot), name=f"load {slot.name}")
        # a failure reaches the waiting requests; this keeps asyncio from also logging it as never retrieved
        slot.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return slot.task

    async def _load(self, slot: Slot) -> None:
        try:
            async with self._load_lock:
                try:
                    if slot.resolved is None:
                        if slot.setup is None:
                            raise slot.error or QuantserveError(f"model {slot.name!r} cannot be resolved")
                        slot.resolve(await _in_thread(slot.setup))
                    if slot.preflight is not None:
                        await _in_thread(slot.preflight)
                    await self._make_room(slot)
                    t = time.perf_counter()
                    log.info("loading model %s", slot.name)
                    llm = await _in_thread(LLM.load, slot.resolved, slot.settings, slot.plan)
                except QuantserveError as exc:
                    self._failed(slot, exc)
                    raise
                except Exception as exc:  # a bug, not a user error: keep the server and say what happened
                    log.exception("could not load model %s", slot.name)
                    err = QuantserveError(f"{type(exc).__name__}: {exc}")
                    self._failed(slot, err)
                    raise err from exc
                seconds = time.perf_counter() - t
                slot.llm, slot.status = llm, "loaded"
                slot.names |= {llm.name.lower()}
                slot.leases += slot.pending  # every waiting request gets its lease before anyone can unload
                slot.pending = 0
                if slot.leases:
                    slot.idle.clear()
                slot.last_used = time.monotonic()
                self.metrics.loads.labels(slot.name, "ok").inc()
                self.metrics.load_seconds.labels(slot.name).observe(seconds)
                self.metrics.ready.labels(slot.name).set(1)
                log.info(
                    "model %s ready in %.1fs: n_ctx %d, %d sequences, backend %s",
                    llm.name,
                    seconds,
                    llm.n_ctx,
                    llm.settings.max_num_seqs,
                    llm.info.backend,
                )
        finally:
            slot.task = None

    def _failed(self, slot: Slot, exc: QuantserveError) -> None:
        slot.status, slot.error, slot.pending, slot.failed_at = "unloaded", exc, 0, time.monotonic()
        self.metrics.loads.labels(slot.name, "error").inc()
        log.error("could not load model %s: %s", slot.name, exc.message)
        if self._on_load_error is not None:
            self._on_load_error()

    async def _make_room(self, target: Slot) -> None:
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
            unloading = [s.task for s in self.slots.values() if s.status == "unloading"]
            if unloading:  # their memory is not free yet
                await asyncio.gather(*(asyncio.shield(t) for t in unloading))
                continue
            loaded = [s for s in self.slots.values() if s.status == "loaded"]
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

    def start_unload(self, slot: Slot, reason: str) -> asyncio.Task:
        """Unload `slot` once its in-flight requests have finished; new requests for it wait, then reload it."""
        if slot.status == "unloading":
            return slot.task
        slot.status = "unloading"
        slot.task = asyncio.get_running_loop().create_task(
            self._unload(slot, reason), name=f"unload {slot.name}"
        )
        return slot.task

    async def _unload(self, slot: Slot, reason: str) -> None:
        try:
            if not slot.idle.is_set():
                log.info(
                    "model %s: waiting for %d request(s) in flight before unloading", slot.name, slot.leases
                )
            await slot.idle.wait()
            llm, slot.llm = slot.llm, None
            if self.single and slot.plan is None:  # a router-mode slot has its plan from before it loaded
                slot.set_plan(llm.plan)  # /v1/models still says what it is
            t = time.perf_counter()
            await _in_thread(llm.close)
            del llm
            await _in_thread(_release_memory)
            self.metrics.unloads.labels(slot.name, reason).inc()
            self.metrics.ready.labels(slot.name).set(0)
            log.info("model %s unloaded (%s) in %.1fs", slot.name, reason, time.perf_counter() - t)
        finally:
            slot.status, slot.task = "unloaded", None

    def can_unload_on_request(self, slot: Slot) -> bool:
        """Whether a client may unload `slot` (Ollama's keep_alive): not a pinned models.toml entry, nor a model
        handed to the app already loaded (nothing could load it again)."""
        return slot.resolved is not None and (self.single or not slot.pinned)

    def unload_on_request(self, slot: Slot, reason: str) -> bool:
        """Unload `slot` once its requests in flight finish, as a client asked; the next request for it loads
        it again (on a single-model server too). Returns False where can_unload_on_request says no."""
        if not self.can_unload_on_request(slot) or slot.status not in ("loaded", "unloading"):
            return False
        slot.parked = True
        self.start_unload(slot, reason)
        return True

    def set_keep_alive(self, slot: Slot, seconds: float | None) -> None:
        """A client's keep_alive: `slot` unloads once idle that long (None: never), until another says else."""
        if not self.can_unload_on_request(slot):
            return
        slot.keep_alive = seconds
        if seconds is not None:
            slot.parked = True
            if self._reaper is None:
                self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="keep_alive")

    async def unload(self, requested: str) -> Slot:
        """Admin unload (POST /models/unload): after the requests in flight on it.

        Raises:
            InvalidRequestError: the model is pinned.
        """
        slot = self.find(requested)
        if slot.pinned:
            raise InvalidRequestError(
                f"model {slot.name!r} is pinned (models.toml pin = true); it stays loaded"
            )
        if slot.status == "loading" and slot.task is not None:
            with contextlib.suppress(
                QuantserveError
            ):  # a failed load leaves it unloaded, which is what was asked
                await asyncio.shield(slot.task)
        if slot.status in ("loaded", "unloading"):
            await asyncio.shield(self.start_unload(slot, "request"))
        return slot

    # ---- lifetime -------------------------------------------------------------------------------

    def start(self) -> None:
        """Load pinned models (a single-model server's one model) now, and start the keep_alive reaper."""
        for slot in self.slots.values():
            if slot.pinned and slot.status == "unloaded" and slot.task is None:
                self._start_load(slot)
        if any(s.keep_alive is not None for s in self.slots.values()):
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="keep_alive")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for slot in self.slots.values():
                # pinned: never, but a single-model server's model once a client has set its keep_alive
                if (
                    slot.status == "loaded"
                    and (not slot.pinned or slot.parked)
                    and slot.keep_alive is not None
                    and slot.leases == 0
                    and now - slot.last_used >= slot.keep_alive
                ):
                    log.info("model %s idle for %.0fs (keep_alive)", slot.name, now - slot.last_used)
                    self.start_unload(slot, "keep_alive")

    def stop(self) -> list[LLM]:
        """On the event loop, at shutdown: stop unloading by idleness and take every loaded model (to close on a
        worker thread). A load still running then finishes unseen; the process exits around it."""
        if self._reaper is not None:
            self._reaper.cancel()
        llms = [s.llm for s in self.slots.values() if s.llm is not None]
        for slot in self.slots.values():
            slot.llm, slot.status = None, "unloaded"
        return llms

    def loaded(self) -> list[tuple[str, LLM]]:
        return [(s.name, s.llm) for s in self.slots.values() if s.llm is not None]
