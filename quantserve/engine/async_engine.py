"""AsyncEngine: runs LLMEngine.step() on a dedicated thread and streams outputs to asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass

from quantserve.core.sequence import Sequence, SequenceOutput
from quantserve.engine.llm_engine import LLMEngine
from quantserve.errors import ServerOverloadedError

log = logging.getLogger("quantserve.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """The engine thread owns the model; asyncio code only submits, aborts and reads its queues.

    Outputs of one step are handed over with one `call_soon_threadsafe` per event loop, so the per-token cost on
    the asyncio side is one queue put per sequence.
    """

    def __init__(self, engine: LLMEngine, *, max_queue_len: int):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._num_waiting = 0  # the scheduler's waiting queue, as the engine thread last saw it
        self._num_inbox_adds = 0  # submitted, not yet taken by the engine thread (guarded by _lock)
        self._stopping = False
        # Refreshed by the engine thread whenever it goes idle: the cells holding KV (llama.cpp's own count where it
        # keeps one, else the ledger's), and the cells the ledger keeps as prefix cache. With nothing running they
        # must be equal (no leaked KV).
        self.kv_cells_used = 0
        self.steps = 0  # engine steps run, in all (a supervisor watches it move while work is pending)
        self.kv_cells_cached = 0
        self._thread = threading.Thread(target=self._run, name="quantserve-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + self._num_inbox_adds

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def generate(self, seq: Sequence) -> RequestStream:
        """Queue a sequence now (raising ServerOverloadedError at once if the queue is full) and return the stream
        of its outputs. Closing the stream early, or cancelling a task waiting on it, aborts the sequence."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._stopping:
                raise ServerOverloadedError("the server is shutting down and accepts no new requests")
            if self._num_waiting + self._num_inbox_adds >= self.max_queue_len:
                raise ServerOverloadedError(
                    f"the request queue is full ({self.max_queue_len} waiting); retry shortly "
                    "or start the server with a larger --max-queue-len"
                )
            self._num_inbox_adds += 1
            self._streams[seq.request_id] = stream
        self._inbox.put(("add", seq))
        return RequestStream(self, seq.request_id, stream.queue)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the thread is dying: no client may be left waiting on it
            log.exception("engine thread failed")
            self._fail_all(RuntimeError(f"the engine stopped: {type(exc).__name__}: {exc}"))
            raise

    def _loop(self) -> None:
        eng = self.engine
        while True:
            block = not eng.has_work()
            if block:
                own = eng.runner.num_kv_used()
                self.kv_cells_used = own if own is not None else eng.kv.num_used + eng.kv.num_cached
                self.kv_cells_cached = eng.kv.num_cached
            try:
                while True:
                    cmd, arg = self._inbox.get(block=block, timeout=None)
                    block = False
                    if cmd == "stop":
                        self._abort_all()
                        return
                    if cmd == "add":
                        eng.add(arg)
                        with self._lock:
                            self._num_inbox_adds -= 1
                            self._num_waiting = len(eng.scheduler.waiting)
                    elif cmd == "abort":
                        out = eng.abort(arg)
                        if out is not None:
                            self._deliver([out])
                        else:
                            self._drop(arg)
            except queue.Empty:
                pass
            try:
                outputs = eng.step()
            except Exception as exc:  # a backend failure must not kill the thread or hang clients
                log.exception("engine step failed; failing the running requests")
                self._fail_all(exc)
                continue
            self._num_waiting = len(eng.scheduler.waiting)
            self.steps += 1
            if outputs:
                self._deliver(outputs)

    def _deliver(self, outputs: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                rid = out.request_id if isinstance(out, SequenceOutput) else out[0]
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                item = out if isinstance(out, SequenceOutput) else out[1]
                if isinstance(item, BaseException) or item.finish_reason is not None:
                    del self._streams[rid]
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed (server shut down)
                loop.call_soon_threadsafe(_put_all, items)

    def _drop(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _fail_all(self, exc: Exception) -> None:
        """Fail every open stream with `exc`, freeing what can be freed; never raises."""
        eng = self.engine
        for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting):
            try:
                eng.abort(seq.request_id)
            except Exception:  # keep going: the streams below must be failed whatever happens here
                log.exception("could not abort %s cleanly", seq.request_id)
        with self._lock:
            open_ids = list(self._streams)
        self._deliver([(rid, exc) for rid in open_ids])

    def _abort_all(self) -> None:
        from quantserve.errors import ModelLoadingError

        self._fail_all(ModelLoadingError("the server is shutting down"))


class RequestStream:
    """The outputs of one sequence. Unlike an async generator, `aclose()` aborts the sequence even when the stream
    was never iterated (an async generator's `finally` would not run then, and the sequence would run on)."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self._engine, self.request_id, self._queue = engine, request_id, queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> SequenceOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the client went away
            self.close()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finish_reason is not None
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def __del__(self) -> None:
        self.close()  # last resort; abort() only enqueues a command, safe from any thread


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)
