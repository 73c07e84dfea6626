"""Continuous-batching scheduler: admits, reuses cached prefixes, chunks prefill, mixes it with decode, preempts.

Pure Python bookkeeping; it never touches the model. A step's plan is a list of (sequence, n_tokens): the first
`n_tokens` uncomputed tokens of each sequence go into one batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from quantserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences decoded together (KV slots)
    max_num_batched_tokens: int  # tokens in one step's batch (llama.cpp n_batch)
    num_kv_cells: int  # KV capacity of all slots together
    max_queue_len: int  # waiting requests beyond which new ones are refused
    # A finished sequence leaves its tokens' KV in its slot, and the next sequence admitted there skips the common
    # prefix (llama-server's prompt cache).
    prefix_caching: bool = False
    # One pool of cells for all slots (llama.cpp's unified KV): cached slots take cells from it and are evicted,
    # oldest first, when running sequences need them. Without it every slot owns num_kv_cells / max_num_seqs.
    shared_kv: bool = True
    # KV is handed out in blocks of this many tokens (the torch backend's paged cache); a sequence holding n tokens
    # uses ceil(n / kv_block_size) blocks. 1 for llama.cpp, whose cells are single tokens.
    kv_block_size: int = 1
    # The backend computes each run of consecutive slot ids as its own pass over the weights (llama.cpp with
    # per-sequence KV). Then a new sequence takes the lowest free slot, keeping the running ones packed, unless
    # another free slot's cached prefix saves at least PACK_MIN_PREFIX_GAIN more prompt tokens.
    pack_slots: bool = False


# A gap among running slots costs an extra weight pass on every decode step while it lasts (~5 ms here with
# SmolLM2, a whole step for a larger model); recomputing 256 prompt tokens costs ~0.5 s here once. Short chat prompts
# share only their template's head, so they pack; a long conversation still gets its own slot back.
PACK_MIN_PREFIX_GAIN = 256


@dataclass(frozen=True)
class Schedule:
    plan: list[tuple[Sequence, int]]
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV; will recompute
    admitted: list[Sequence] = field(default_factory=list)  # new in a slot; its KV past num_computed is stale
    evicted: list[int] = field(default_factory=list)  # free slots whose cached KV must be dropped


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.slot_tokens: dict[int, list[int]] = {}  # free slot -> tokens whose KV it still holds

    # ---- admission ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _cells(self, n_tokens: int) -> int:
        """KV cells a sequence of n_tokens holds: whole blocks."""
        bs = self.config.kv_block_size
        return -(-n_tokens // bs) * bs

    @property
    def num_kv_used(self) -> int:
        return sum(self._cells(s.num_computed) for s in self.running)

    @property
    def num_kv_cached(self) -> int:
        return sum(len(t) for t in self.slot_tokens.values())

    def _kv_free(self) -> int:
        cached = self.num_kv_cached if self.config.shared_kv else 0
        return self.config.num_kv_cells - self.num_kv_used - cached

    def _evict(self, need: int, evicted: list[int]) -> None:
        """Drop cached slots, oldest first, until `need` cells are free (shared pool only)."""
        while self.config.shared_kv and self._kv_free() < need and self.slot_tokens:
            slot = next(iter(self.slot_tokens))
            del self.slot_tokens[slot]
            evicted.append(slot)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> Schedule:
        """Plan one batch: decode tokens first, then prefill chunks of running sequences, then new admissions."""
        cfg = self.config
        preempted: list[Sequence] = []
        evicted: list[int] = []
        # Room for one more token per running sequence: evict cached prefixes first, then preempt the newest.
        self._evict(self._decode_need(), evicted)
        while self.running and self._kv_free() < self._decode_need():
            preempted.append(self._preempt(self.running[-1]))
        budget = cfg.max_num_batched_tokens
        kv_free = self._kv_free()
        plan: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.num_uncomputed == 1 and budget > 0:
                plan.append((seq, 1))
                budget -= 1
                kv_free -= self._growth(seq, 1)
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:
                n = min(seq.num_uncomputed, budget, self._fits(seq, kv_free))
                if n > 0:
                    plan.append((seq, n))
                    budget -= n
                    kv_free -= self._growth(seq, n)
        # Admit while slots, budget and KV remain; only if the whole prompt fits, so prefills do not thrash.
        admitted: list[Sequence] = []
        while self.waiting and self._free_slots and budget > 0:
            seq = self.waiting[0]
            slot, n_cached = self._pick_slot(seq)
            need = self._cells(len(seq.tokens)) - self._cells(n_cached)
            # Cells free once every other cached slot is evicted and this one is trimmed to the shared prefix.
            slot_cached = len(self.slot_tokens.get(slot, [])) if cfg.shared_kv else 0
            others = self.num_kv_cached - slot_cached if cfg.shared_kv else 0
            if need > kv_free + others + slot_cached - n_cached and self.running:
                break
            planned = self._kv_free() - kv_free  # cells this step's plan already takes on
            self.waiting.popleft()
            self._take_slot(seq, slot, n_cached)
            admitted.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)  # now its cached prefix counts as used
            self._evict(need + planned, evicted)
            kv_free = self._kv_free() - planned
            n = min(seq.num_uncomputed, budget, self._fits(seq, kv_free))
            if n > 0:
                plan.append((seq, n))
                budget -= n
                kv_free -= self._growth(seq, n)
        return Schedule(plan, preempted, admitted, evicted)

    def _growth(self, seq: Sequence, n: int) -> int:
        """Cells `seq` takes on by computing n more tokens."""
        return self._cells(seq.num_computed + n) - self._cells(seq.num_computed)

    def _fits(self, seq: Sequence, kv_free: int) -> int:
        """How many more tokens of `seq` fit in kv_free cells (its last block's spare room included)."""
        bs = self.config.kv_block_size
        return max(self._cells(seq.num_computed) + kv_free // bs * bs - seq.num_computed, 0)

    def _decode_need(self) -> int:
        """Cells every running sequence needs to advance by one token."""
        return sum(self._growth(s, 1) for s in self.running)

    def _pick_slot(self, seq: Sequence) -> tuple[int, int]:
        """The free slot for `seq` and how many of its cached tokens `seq` reuses (never its last token: its logits
        are needed). With prefix caching, the slot sharing the longest prefix (pack_slots: the lowest free slot unless
        that saves PACK_MIN_PREFIX_GAIN more tokens); without, the lowest free slot and 0."""
        lowest = min(self._free_slots)
        if not self.config.prefix_caching:
            return lowest, 0

        def reusable(slot: int) -> int:
            return min(common_prefix_len(self.slot_tokens.get(slot, []), seq.tokens), len(seq.tokens) - 1)

        # Ties: an empty slot before a cached one, then the oldest cache (kept newest-last), then the lowest slot.
        age = {slot: i for i, slot in enumerate(self.slot_tokens)}
        best = max(self._free_slots, key=lambda s: (reusable(s), s not in age, -age.get(s, 0), -s))
        if self.config.pack_slots and reusable(best) - reusable(lowest) < PACK_MIN_PREFIX_GAIN:
            best = lowest
        return best, reusable(best)

    def _take_slot(self, seq: Sequence, slot: int, n_cached: int) -> None:
        self._free_slots.remove(slot)
        self.slot_tokens.pop(slot, None)
        seq.seq_id = slot
        seq.num_computed = n_cached

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

    def finish(self, seq: Sequence, status: SequenceStatus) -> bool:
        """Remove a sequence (running or waiting) for good. Returns whether its slot keeps the KV as a prefix cache;
        otherwise the caller frees the KV in the model."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.seq_id)
            if self.config.prefix_caching and seq.num_computed:
                self.slot_tokens[seq.seq_id] = seq.tokens[: seq.num_computed]  # newest last: evicted last
                return True
        elif seq in self.waiting:
            self.waiting.remove(seq)
        return False
