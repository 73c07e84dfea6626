"""SlotKV: llama.cpp's sequence slots as a KV ledger, with a prefix cache by slot.

A sequence runs in a slot (llama.cpp's seq id; its block table is that one number). With per-sequence KV each slot
owns cells / num_slots cells; with the unified pool (`shared`) all slots draw on one pool of cells, and a
sequence's cells are counted from its admission (its whole prompt) so that a step is never planned past the pool.

A finished sequence leaves its KV in its slot, and the next sequence admitted there reuses the prefix they share
(llama-server's prompt cache); in the unified pool, slots that only cache are emptied, oldest first, when running
sequences need their cells. The runner is told which cached KV to drop (DropKV).

With per-sequence KV, a prefix is also copied between slots (CopyKV): a sequence whose slot holds less of its
prefix than another slot does, free or running, gets that slot's cells when that saves MIN_COPY_GAIN tokens or
more. So once a shared prefix (a long system prompt, a rerank request's query) is computed, or being computed by
a running sequence, later sequences do not compute it again in other slots; sequences admitted in the same step
before any has computed it each still do. llama.cpp copies a whole per-sequence stream (n_ctx cells of every
layer: 47 MB for SmolLM2 at 2048 cells, a few ms), which the gain must outweigh.

With `pack`, a new sequence takes the lowest free slot: llama.cpp computes each run of consecutive seq ids as its
own pass over the weights, so a gap among the running slots costs a pass on every step it lasts (about 5 ms with
SmolLM2 on 2 cores, a whole step for a larger model); recomputing 256 prompt tokens costs ~0.5 s here once. So a
higher slot wins only if its cached prefix saves PACK_MIN_PREFIX_GAIN more tokens: short chat prompts share only
their template's head and pack; a long conversation still gets its own slot back.

With a `window` (llama.cpp's sliding-window layers when swa_full is off), a slot's windowed layers keep only the
last `window` positions of what it computed: llama.cpp may give a cell of position p to a new token once p <=
P + 1 - window (src/llama-kv-cache.cpp, is_masked_swa against the sequence's next position). With per-sequence
streams only the slot's own tokens take its cells, so after computing 0..P it has lost at most positions up to
P - window; in the unified pool any sequence's token may take them, up to P + 1 - window. A sequence resuming after
a prefix of n tokens attends, in those layers, to positions n - window + 1 .. n, so the prefix is reusable only if
it continues everything the slot computed (n >= P, or n > P in the unified pool: a chat's next turn) or nothing
can be lost yet (P < window, P + 1 < window). Any other match is recomputed from 0, as llama-server does without
its checkpoints.
"""

from __future__ import annotations

from quantserve.core.runner import CopyKV, DropKV
from quantserve.core.sequence import Sequence

PACK_MIN_PREFIX_GAIN = 256
MIN_COPY_GAIN = 32


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotKV:
    """The ledger of llama.cpp's slots. Not thread-safe (the engine thread is its only user)."""

    def __init__(
        self,
        num_slots: int,
        cells: int,
        *,
        shared: bool,
        prefix_caching: bool,
        pack: bool = False,
        window: int = 0,
    ):
        self.num_slots, self.cells, self.shared, self.window = num_slots, cells, shared, window
        self.per_slot = cells if shared else cells // num_slots
        self.prefix_caching, self.pack = prefix_caching, pack
        self._free_slots = list(range(num_slots))
        self.slot_tokens: dict[int, list[int]] = {}  # free slot -> tokens its KV still holds (oldest first)
        self._reserved: dict[int, int] = {}  # seq_id -> cells counted for it
        # slot -> its sequence: the cells below its num_computed are valid (a donor for CopyKV)
        self._running: dict[int, Sequence] = {}
        self._ops: list[DropKV | CopyKV] = []

    # ---- counts ------------------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return sum(self._reserved.values())

    @property
    def num_cached(self) -> int:
        return sum(len(t) for t in self.slot_tokens.values())

    def _pool_free(self) -> int:
        """Unified pool: cells neither counted for a running sequence nor caching."""
        return self.cells - self.num_used - self.num_cached

    def take_ops(self) -> list[DropKV | CopyKV]:
        ops, self._ops = self._ops, []
        return ops

    # ---- the contract -------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        if not self._free_slots:
            return False
        if not self.shared:
            return len(seq.tokens) <= self.per_slot
        slot, n_cached = self._pick(seq)
        # the cells free once every other slot's cache is dropped and this slot's is cut to the shared prefix
        return len(seq.tokens) - n_cached <= self._pool_free() + self.num_cached - n_cached

    def allocate(self, seq: Sequence) -> None:
        slot, n_cached = self._pick(seq)
        self._free_slots.remove(slot)
        held = self.slot_tokens.pop(slot, None)
        donor, n_donor = self._donor(seq, slot)
        if n_donor >= n_cached + MIN_COPY_GAIN:
            self._ops.append(CopyKV(donor, slot, n_donor))  # replaces all the slot held
            n_cached = n_donor
        elif held is not None and len(held) > n_cached:
            self._ops.append(DropKV(slot, n_cached))
        seq.block_table = [slot]
        seq.num_computed = n_cached
        self._reserved[seq.seq_id] = len(seq.tokens)
        self._running[slot] = seq
        self._evict()

    def can_append(self, seq: Sequence) -> bool:
        if not self.shared:
            return len(seq.tokens) <= self.per_slot
        return len(seq.tokens) - self._reserved[seq.seq_id] <= self._pool_free() + self.num_cached

    def append(self, seq: Sequence) -> None:
        self._reserved[seq.seq_id] = len(seq.tokens)
        self._evict()

    def deallocate(self, seq: Sequence) -> None:
        slot = seq.block_table[0]
        self._running.pop(slot, None)
        self._free_slots.append(slot)
        self._reserved.pop(seq.seq_id, None)
        if self.prefix_caching and seq.num_computed:
            self.slot_tokens[slot] = seq.cache_tokens[: seq.num_computed]  # newest last: emptied last
        else:
            self._ops.append(DropKV(slot))
        seq.block_table = []

    # ---- internals ----------------------------------------------------------------------------------

    def _evict(self) -> None:
        """Unified pool: empty cached slots, oldest first, until the running sequences' cells fit."""
        while self.shared and self._pool_free() < 0 and self.slot_tokens:
            slot = next(iter(self.slot_tokens))
            del self.slot_tokens[slot]
            self._ops.append(DropKV(slot))

    def _pick(self, seq: Sequence) -> tuple[int, int]:
        """The free slot for `seq` and how many of its cached tokens `seq` reuses (never its last token: its logits
        are needed). With prefix caching, the slot sharing the longest prefix (pack: the lowest free slot unless
        that saves PACK_MIN_PREFIX_GAIN more tokens); without, the lowest free slot and 0."""
        lowest = min(self._free_slots)
        if not self.prefix_caching:
            return lowest, 0

        def reusable(slot: int) -> int:
            return _reusable(seq, self.slot_tokens.get(slot, []), self.window, self.shared)

        # Ties: an empty slot before a cached one, then the oldest cache (kept newest-last), then the lowest slot.
        age = {slot: i for i, slot in enumerate(self.slot_tokens)}
        best = max(self._free_slots, key=lambda s: (reusable(s), s not in age, -age.get(s, 0), -s))
        if self.pack and reusable(best) - reusable(lowest) < PACK_MIN_PREFIX_GAIN:
            best = lowest
        return best, reusable(best)

    def _donor(self, seq: Sequence, slot: int) -> tuple[int, int]:
        """The other slot holding the longest prefix of `seq` (free and caching, or running) and its length; the
        length is 0 where prefixes are not copied (no prefix caching, or the unified pool, where llama.cpp shares
        cells between sequences instead and this ledger counts each sequence's own)."""
        if not self.prefix_caching or self.shared:
            return slot, 0
        held = {s: t for s, t in self.slot_tokens.items() if s != slot}
        held.update({s: r.cache_tokens[: r.num_computed] for s, r in self._running.items() if s != slot})
        best = max(held, key=lambda s: (_reusable(seq, held[s], self.window), -s), default=slot)
        return best, _reusable(seq, held[best], self.window) if best != slot else 0  # (streams only)


def _reusable(seq: Sequence, held: list[int], window: int = 0, shared: bool = False) -> int:
    """How many of `held`'s tokens `seq` can reuse: their common prefix, never seq's last token (its logits are
    needed), never ending inside an image (libmtmd evaluates an image whole), and with a `window`, none unless
    the windowed layers still hold what the prefix needs (see the module docstring)."""
    keys = seq.cache_tokens
    n = min(common_prefix_len(held, keys), len(keys) - 1)
    n = next((s.offset for s in seq.images if s.offset < n < s.end), n)
    last = len(held) - 1 + shared  # the last position the slot computed, one more where others take its cells
    return n if not window or last < window or n >= last else 0
