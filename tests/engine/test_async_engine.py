"""AsyncEngine with a stand-in runner: the queue bound holds under a burst, and aborts free everything."""

from __future__ import annotations

import asyncio
import threading

import pytest

from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import SampledToken, Sequence
from quantserve.engine.async_engine import AsyncEngine
from quantserve.engine.kv import SlotKV
from quantserve.engine.llm_engine import LLMEngine
from quantserve.engine.scheduler import SchedulerConfig
from quantserve.errors import ServerOverloadedError


class SlowRunner:
    """Samples token 5 for every finished chunk, after waiting on a gate, so sequences never finish by themselves."""

    n_ctx = 1000

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.freed: list[str] = []

    def is_eog(self, token: int) -> bool:
        return False

    def token_bytes(self, token: int) -> bytes:
        return b"x"

    def execute(self, plan):
        self.gate.wait(0.01)
        out = []
        for seq, n in plan:
            seq.num_computed += n
            out.append(SampledToken(5) if seq.num_computed == len(seq.tokens) else None)
        return out

    def release(self, seq, *, keep_sampler: bool = False) -> None:
        self.freed.append(seq.request_id)

    def drop_kv(self, ops) -> None:
        pass

    def num_kv_used(self) -> int:
        return 0


def _engine(runner, *, seqs: int, cells: int, queue: int) -> AsyncEngine:
    kv = SlotKV(seqs, cells, shared=True, prefix_caching=False)
    return AsyncEngine(LLMEngine(runner, SchedulerConfig(seqs, 64, queue), kv), max_queue_len=queue)


def _seq(rid: str) -> Sequence:
    p = SamplingParams(max_tokens=10**6)
    return Sequence(rid, [1, 2, 3], p, IncrementalDetokenizer(), max_total_tokens=10**7)


def test_queue_bound_holds_for_a_burst_and_aborts_free_everything():
    runner = SlowRunner()
    engine = _engine(runner, seqs=1, cells=10**7, queue=2)

    async def main() -> tuple[int, int]:
        accepted, refused = [], 0
        for i in range(10):  # a burst faster than the engine thread takes requests in
            try:
                accepted.append(engine.generate(_seq(str(i))))
            except ServerOverloadedError:
                refused += 1
        first = await accepted[0].__anext__()  # the running one streams
        assert first.text == "x"
        for gen in accepted:
            await gen.aclose()  # client gone: abort
        return len(accepted), refused

    try:
        n_accepted, n_refused = asyncio.run(main())
        # one may already be running when the burst fills the queue; never more than slots + queue
        assert n_accepted <= 1 + 2 and n_refused >= 7
        for _ in range(200):
            if not engine.engine.has_work():
                break
            threading.Event().wait(0.01)
        assert not engine.engine.has_work()
        assert len(set(runner.freed)) == n_accepted
    finally:
        engine.stop()


def test_stop_fails_waiting_streams_cleanly():
    runner = SlowRunner()
    engine = _engine(runner, seqs=1, cells=10**7, queue=8)

    async def main():
        gen = engine.generate(_seq("a"))
        await gen.__anext__()
        engine.stop()
        with pytest.raises(Exception, match="shutting down"):
            async for _ in gen:
                pass

    asyncio.run(main())


def test_a_failing_backend_fails_the_streams_instead_of_hanging():
    class BrokenRunner(SlowRunner):
        def execute(self, plan):
            raise RuntimeError("backend exploded")

        def free(self, seq, *, keep_sampler: bool = False, keep_kv: bool = False) -> None:
            raise RuntimeError("and cannot even free")

    engine = _engine(BrokenRunner(), seqs=2, cells=100, queue=8)

    async def main():
        gen = engine.generate(_seq("a"))
        with pytest.raises(RuntimeError, match="exploded"):
            await asyncio.wait_for(gen.__anext__(), timeout=10)

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done():
    from quantserve.server.generation import event_stream
    from quantserve.server.openai.routes import _Encoder

    async def chunks():
        yield b"data: {}\n\n"
        raise RuntimeError("backend exploded")

    async def main():
        return [c async for c in event_stream(chunks(), _Encoder.error).body_iterator]

    out = asyncio.run(main())
    assert out[0] == b"data: {}\n\n" and b'"error"' in out[1] and b"backend exploded" in out[1]
    assert out[-1] == b"data: [DONE]\n\n"
