"""LLMEngine: one synchronous step = schedule → execute on the backend → detokenize, stop, finish."""

from __future__ import annotations

import logging
import time

from quantserve.core.runner import KVCacheFull, ModelRunner
from quantserve.core.sequence import Sequence, SequenceOutput, SequenceStatus
from quantserve.engine.kv import KVManager
from quantserve.engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("quantserve.engine")


class LLMEngine:
    """Owns the scheduler and its KV ledger; the runner executes what they plan."""

    def __init__(self, runner: ModelRunner, config: SchedulerConfig, kv: KVManager):
        self.runner = runner
        self.kv = kv
        self.scheduler = Scheduler(config, kv)
        self._by_id: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self._by_id[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> SequenceOutput | None:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._drop_kv()
        self.runner.release(seq)
        return self._output(seq, "", None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _drop_kv(self) -> None:
        """Make the runner's cache agree with the ledger at once (a finished sequence's KV is freed now)."""
        ops = self.kv.take_ops()
        if ops:
            self.runner.drop_kv(ops)

    def step(self) -> list[SequenceOutput]:
        sched = self.scheduler.schedule()
        plan = sched.plan
        if sched.kv_ops:
            self.runner.drop_kv(sched.kv_ops)
        for seq in sched.preempted:
            log.info("preempted %s (KV full); it will be recomputed", seq.request_id)
            self.runner.release(seq, keep_sampler=True)
        if not plan:
            return []
        t0 = time.perf_counter()
        try:
            sampled = self.runner.execute(plan)
        except KVCacheFull:  # not in normal operation: the ledger plans within the cache
            victim = self.scheduler.preempt_newest()
            if victim is not None:
                self.runner.release(victim, keep_sampler=True)
                self._drop_kv()
            return []
        self.scheduler.postprocess(plan)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step: %d sequences, %d tokens, %.1f ms",
                len(plan),
                sum(n for _, n in plan),
                1000 * (time.perf_counter() - t0),
            )
        outputs: list[SequenceOutput] = []
        for (seq, _), result in zip(plan, sampled, strict=True):
            if result is None:
                continue
            out = self._append(seq, result.token, result.logprob)
            if out is not None:
                outputs.append(out)
        return outputs

    def _append(self, seq: Sequence, token: int, logprob) -> SequenceOutput | None:
        p = seq.params
        thinking = seq.thinking
        if (
            thinking is not None and thinking.forcing
        ):  # a spent thinking budget: its end marker goes in instead
            token, logprob = thinking.next_token(token), None
        # ignore_eos does not hold against a grammar: once it is complete, the end is all it allows
        if self.runner.is_eog(token) and (not p.ignore_eos or seq.guide is not None):
            return self._finish(seq, SequenceStatus.FINISHED_STOPPED, seq.detokenizer.flush(), None)
        if seq.guide is not None and not seq.guide.accept(token):
            # The token came through the guide's own mask, so this is a bug, not bad input: end the sequence
            # cleanly rather than sample on with a broken grammar.
            log.error(
                "%s: token %d broke its grammar (%s); stopping it", seq.request_id, token, seq.guide.error
            )
            return self._finish(seq, SequenceStatus.FINISHED_STOPPED, seq.detokenizer.flush(), None)
        seq.tokens.append(token)
        seq.pending_tokens.append(token)
        if p.skip_special_tokens:
            piece = self.runner.token_bytes(token)
        else:
            piece = self.runner.token_bytes(token, special=True)
        if thinking is not None:
            thinking.observe(
                piece if not p.skip_special_tokens else self.runner.token_bytes(token, special=True)
            )
        text, hit_stop = seq.detokenizer.add(piece)
        lps = [logprob] if logprob is not None else None
        if hit_stop:
            seq.stop_hit = seq.detokenizer.hit
            return self._finish(seq, SequenceStatus.FINISHED_STOPPED, text, lps)
        if seq.num_output_tokens >= p.max_tokens or len(seq.tokens) >= seq.max_total_tokens:
            return self._finish(seq, SequenceStatus.FINISHED_LENGTH, text + seq.detokenizer.flush(), lps)
        if not text and lps is None:
            return (
                None  # held back (partial UTF-8 or a possible stop string); its token goes out with the next
            )
        return self._output(seq, text, lps)

    def _finish(self, seq, status, text, lps) -> SequenceOutput:
        self.scheduler.finish(seq, status)
        self._drop_kv()
        self.runner.release(seq)
        self._by_id.pop(seq.request_id, None)
        return self._output(seq, text, lps)

    @staticmethod
    def _output(seq: Sequence, text: str, lps) -> SequenceOutput:
        token_ids, seq.pending_tokens = seq.pending_tokens, []
        return SequenceOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=token_ids,
            logprobs=lps,
            finish_reason=seq.status.value if seq.status.finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            stop=seq.stop_hit,
            num_reasoning_tokens=seq.thinking.count if seq.thinking is not None else 0,
        )
