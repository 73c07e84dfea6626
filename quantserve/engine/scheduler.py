"""Continuous-batching scheduler: admits, chunks prefill, mixes it with decode, preempts, and keeps the KV ledger.

Pure Python bookkeeping; it never touches the model. A step's plan is a list of (sequence, n_tokens): the first
`n_tokens` uncomputed tokens of each sequence go into one batch. The KV ledger (quantserve.engine.kv) is the
scheduler's: a sequence gets its block table when admitted (for its whole prompt, less a cached prefix), one more
token's room each decode step, and gives it back when it finishes or is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from quantserve.core.runner import CopyKV, DropKV
from quantserve.core.sequence import Sequence, SequenceStatus
from quantserve.engine.kv import KVManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences decoded together
    max_num_batched_tokens: int  # tokens in one step's batch (llama.cpp n_batch)
    max_queue_len: int  # waiting requests beyond which new ones are refused


@dataclass(frozen=True)
class Schedule:
    plan: list[tuple[Sequence, int]]
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV; will recompute
    admitted: list[Sequence] = field(default_factory=list)
    kv_ops: list[DropKV | CopyKV] = field(
        default_factory=list
    )  # cache changes the runner makes before this step


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        """Plan one batch: decode tokens first (preempting the newest sequences while the cache lacks room), then
        prefill chunks of running sequences, then new admissions, within the token budget."""
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1 or budget <= 0:
                continue
            while not self.kv.can_append(seq):
                preempted.append(self._preempt(self.running[-1]))
                if preempted[-1] is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.kv.append(seq)
                plan.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:  # a prompt still being read: its room is already taken
                n = min(seq.num_uncomputed, budget)
                plan.append((seq, n))
                budget -= n
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.kv.can_allocate(seq):
                break
            self.waiting.popleft()
            self.kv.allocate(seq)  # its cached prefix counts as computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            n = min(seq.num_uncomputed, budget)
            plan.append((seq, n))
            budget -= n
        return Schedule(plan, preempted, admitted, self.kv.take_ops())

    def _preempt(self, seq: Sequence) -> Sequence:
        """Take a running sequence's KV; it goes back to the front of the queue and recomputes its tokens (its
        prefix may well still be cached by then)."""
        self.running.remove(seq)
        self.kv.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        return seq

    def postprocess(self, plan: list[tuple[Sequence, int]]) -> None:
        """After the runner has executed `plan`: each sequence's n tokens are in the cache now. The one place that
        advances num_computed (the KV ledger sets it only to a cached prefix, or back to 0 on preemption)."""
        for seq, n in plan:
            seq.num_computed += n

    def preempt_newest(self) -> Sequence | None:
        return self._preempt(self.running[-1]) if self.running else None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence (running or waiting) for good; its KV goes back to the ledger."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
            self.kv.deallocate(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
