"""Continuous-batching scheduler: admits, chunks prefill, mixes it with decode, preempts on KV pressure.

Pure Python bookkeeping; it never touches the model. A step's plan is a list of (sequence, n_tokens): the first
`n_tokens` uncomputed tokens of each sequence go into one batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from quantserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences decoded together (KV slots)
    max_num_batched_tokens: int  # tokens in one step's batch (llama.cpp n_batch)
    num_kv_cells: int  # KV capacity shared by all sequences
    max_queue_len: int  # waiting requests beyond which new ones are refused


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))

    # ---- admission ---------------------------------------------------------------------------

    def can_add(self) -> bool:
        return len(self.waiting) < self.config.max_queue_len

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_kv_used(self) -> int:
        return sum(s.num_computed for s in self.running)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Plan one batch. Returns (plan, preempted) where preempted sequences lost their KV (recompute later)."""
        cfg = self.config
        preempted: list[Sequence] = []
        # Decode first: every running sequence that has only its last sampled token to feed.
        # If the KV cannot hold one more token each, preempt the newest until it can.
        while self.running and self.num_kv_used + len(self.running) > cfg.num_kv_cells:
            preempted.append(self._preempt(self.running[-1]))
        budget = cfg.max_num_batched_tokens
        kv_free = cfg.num_kv_cells - self.num_kv_used
        plan: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.num_uncomputed == 1 and budget > 0:
                plan.append((seq, 1))
                budget -= 1
                kv_free -= 1
        # Then continue chunked prefills of running sequences, oldest first.
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0 and kv_free > 0:
                n = min(seq.num_uncomputed, budget, kv_free)
                plan.append((seq, n))
                budget -= n
                kv_free -= n
        # Then admit waiting sequences while slots, budget and KV remain. A sequence is admitted only if its whole
        # prompt fits in the free KV, so prefills do not thrash each other.
        while self.waiting and self._free_slots and budget > 0:
            seq = self.waiting[0]
            if seq.num_uncomputed > kv_free and self.running:
                break
            self.waiting.popleft()
            seq.seq_id = self._free_slots.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget, kv_free)
            if n > 0:
                plan.append((seq, n))
                budget -= n
                kv_free -= n
        return plan, preempted

    def _preempt(self, seq: Sequence) -> Sequence:
        """Drop a running sequence's KV; it goes back to the front of the queue and recomputes its tokens."""
        self.running.remove(seq)
        self._free_slots.append(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        return seq

    def preempt_newest(self) -> Sequence | None:
        return self._preempt(self.running[-1]) if self.running else None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence (running or waiting) for good. The caller frees its KV slot in the model."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
