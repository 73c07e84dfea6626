"""PagedKV: a pool of fixed-size KV blocks handed to sequences as block tables, with automatic prefix caching.

vLLM's PagedAttention layout (nano-vllm's `block_manager.py`): the cache is `num_blocks` blocks of `block_size`
token slots; a sequence's token at position `pos` lives in slot `block_table[pos // block_size] * block_size +
pos % block_size`.

Prefix caching is vLLM's automatic one: a block full of computed tokens is registered under a hash of its tokens
chained to the hash of the block before it, so a hash names a whole prefix. A new sequence takes, block by block,
the registered blocks its prompt begins with, and computes only the rest. Blocks are reference-counted while in
use; a block no sequence uses goes to the free list and keeps its hash, so a later prompt can still take it, until
the room is needed: blocks are taken from the free list least recently freed first, and a sequence's later blocks
are freed before its earlier ones (the earlier a block, the more prompts share it). Only blocks before a prompt's
last token are ever reused (its logits are needed), and shared blocks are only read.

A model with linear-attention layers (Qwen3.5) also keeps a fixed-size recurrent state per running sequence: the
ledger hands each admitted sequence one of `state_slots` slots with its blocks (`seq.state_slot`) and takes it
back with them, so admission waits for a slot as for blocks, and preemption and cancellation free both. Such a
state holds a whole prefix and cannot be cut at a block, so prefix caching is off for these models (the runner
says so in its KVSpec).
"""

from __future__ import annotations

from collections import OrderedDict

from quantserve.core.runner import DropKV
from quantserve.core.sequence import Sequence


class PagedKV:
    """The ledger of a paged cache. Not thread-safe (the engine thread is its only user)."""

    def __init__(
        self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, state_slots: int = 0
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token; got {num_blocks} x {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # first out: least recent
        self._hash: list[int | None] = [None] * num_blocks  # a registered block's prefix hash
        self._tokens: list[tuple | None] = [None] * num_blocks  # and its tokens (a hit must match)
        self._by_hash: dict[int, int] = {}
        self._registered: dict[int, tuple[int, int | None]] = {}  # seq_id -> (blocks registered, last hash)
        self.hits = 0  # tokens taken from the cache by allocations, in all (for tests and logs)
        if state_slots and prefix_caching:  # a cache hit would continue a slot's state from another sequence
            raise ValueError("prefix caching cannot serve a model with recurrent state slots")
        self.state_slots = state_slots
        self.free_states = list(range(state_slots))[::-1]  # recurrent-state slots; pop() takes the lowest

    # ---- counts ------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return (self.num_blocks - len(self.free)) * self.block_size

    @property
    def num_cached(self) -> int:
        return sum(1 for b in self.free if self._hash[b] is not None) * self.block_size

    def take_ops(self) -> list[DropKV]:
        return []  # a block's old contents are simply overwritten

    # ---- the contract -------------------------------------------------------------------------------

    def _blocks(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _hits(self, seq: Sequence) -> list[int]:
        """The registered blocks seq's prompt begins with, up to (not including) the block of its last token."""
        if not self.prefix_caching:
            return []
        bs, tokens, out, h = self.block_size, seq.cache_tokens, [], None
        for i in range((len(tokens) - 1) // bs):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((h, block))
            b = self._by_hash.get(h)
            if b is None or self._tokens[b] != block:
                break
            out.append(b)
        return out

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._hits(seq)
        need = self._blocks(len(seq.tokens)) - len(hits)
        if self.state_slots and not self.free_states:
            return False
        return need <= len(self.free) - sum(1 for b in hits if self.ref[b] == 0)

    def allocate(self, seq: Sequence) -> None:
        hits = self._hits(seq)
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        seq.block_table = hits + [self._take() for _ in range(self._blocks(len(seq.tokens)) - len(hits))]
        seq.num_computed = len(hits) * self.block_size
        self.hits += seq.num_computed
        self._registered[seq.seq_id] = (len(hits), self._hash[hits[-1]] if hits else None)
        if self.state_slots:
            seq.state_slot = self.free_states.pop()

    def can_append(self, seq: Sequence) -> bool:
        return self._blocks(len(seq.tokens)) - len(seq.block_table) <= len(self.free)

    def append(self, seq: Sequence) -> None:
        while len(seq.block_table) < self._blocks(len(seq.tokens)):
            seq.block_table.append(self._take())
        self._register(seq)

    def deallocate(self, seq: Sequence) -> None:
        self._register(seq)
        for b in reversed(seq.block_table):  # later blocks out first: the earlier, the more prompts share it
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self._hash[b] is None:  # holds nothing reusable: the first to be taken again
                    self.free.move_to_end(b, last=False)
        seq.block_table = []
        self._registered.pop(seq.seq_id, None)
        if seq.state_slot >= 0:
            self.free_states.append(seq.state_slot)
            seq.state_slot = -1

    # ---- internals ----------------------------------------------------------------------------------

    def _take(self) -> int:
        """A free block, least recently freed first; it forgets what it cached."""
        if not self.free:
            raise RuntimeError("the KV ledger handed out more blocks than it has (a scheduler bug)")
        b, _ = self.free.popitem(last=False)
        h = self._hash[b]
        if h is not None:
            if self._by_hash.get(h) == b:
                del self._by_hash[h]
            self._hash[b] = self._tokens[b] = None
        self.ref[b] = 1
        return b

    def _register(self, seq: Sequence) -> None:
        """Make the blocks seq has filled with computed tokens findable by later prompts."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        done, h = self._registered.get(seq.seq_id, (0, None))
        full = min(seq.num_computed // bs, len(seq.block_table))
        tokens = seq.cache_tokens if full > done else []
        for i in range(done, full):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((h, block))
            b = seq.block_table[i]
            if h not in self._by_hash and self._hash[b] is None:
                self._by_hash[h] = b
                self._hash[b], self._tokens[b] = h, block
        if full > done:
            self._registered[seq.seq_id] = (full, h)
