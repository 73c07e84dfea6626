"""Paged KV cache bookkeeping: which physical blocks each sequence owns, and where each token's K/V goes.

vLLM's PagedAttention layout (nano-vllm `engine/block_manager.py`, without its prefix cache): the KV cache is
`num_blocks` blocks of `block_size` token slots; a sequence owns a block table, and its token at position `pos`
lives in slot `block_table[pos // block_size] * block_size + pos % block_size`. Blocks are handed out on demand
as a sequence grows and all return to the pool when it ends. Pure Python: it never touches the cache itself.

Sequences are named by a key (the engine's `request_id`, unique among live sequences); counts are totals, so
`append_slots(key, n)` means "make positions 0..n-1 of this sequence addressable".
"""

from __future__ import annotations

from quantserve.backends import KVCacheFull


class NoFreeBlocks(KVCacheFull):
    """Not enough free KV blocks; as a KVCacheFull, the engine answers it by preempting a sequence."""


class BlockManager:
    """Allocates KV blocks to sequences. Not thread-safe (the engine thread is its only user)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token; got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: the most recently freed (still cache-warm) block is reused first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    # ---- counting ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_tokens_capacity(self, key: str) -> int:
        """Positions the sequence can address with the blocks it owns now (0 when it owns none)."""
        return len(self._tables.get(key, ())) * self.block_size

    def _missing(self, key: str, num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(self._tables.get(key, ())))

    # ---- allocation -------------------------------------------------------------------------------

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits in the free blocks."""
        return self.num_blocks_for(num_tokens) <= len(self._free)

    def allocate(self, key: str, num_tokens: int) -> None:
        """Give a new sequence blocks for its first `num_tokens` tokens.

        Raises:
            ValueError: `key` already owns blocks (deallocate it first).
            NoFreeBlocks: not enough free blocks; nothing is allocated.
        """
        if key in self._tables:
            raise ValueError(f"sequence {key!r} already owns {len(self._tables[key])} KV blocks")
        self.append_slots(key, num_tokens)

    def can_append(self, key: str, num_tokens: int) -> bool:
        """Whether the sequence can grow to `num_tokens` tokens (total, not extra) with the free blocks."""
        return self._missing(key, num_tokens) <= len(self._free)

    def append_slots(self, key: str, num_tokens: int) -> None:
        """Make sure positions 0..num_tokens-1 of the sequence have slots, taking free blocks as needed.
        A sequence with no blocks yet starts a table. All or nothing: on failure no block changes hands.

        Raises:
            NoFreeBlocks: with the numbers, when the free blocks are too few.
        """
        need = self._missing(key, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocks(
                f"sequence {key!r} needs {need} more KV blocks for {num_tokens} tokens but only "
                f"{len(self._free)} of {self.num_blocks} are free (block size {self.block_size})"
            )
        table = self._tables.setdefault(key, [])
        for _ in range(need):
            table.append(self._free.pop())

    def deallocate(self, key: str) -> None:
        """Return all of the sequence's blocks to the pool. A key that owns none (never allocated, or already
        deallocated) is a no-op, so a runner may free a sequence whatever state it is in."""
        table = self._tables.pop(key, None)
        if table:
            self._free.extend(reversed(table))

    # ---- addressing -------------------------------------------------------------------------------

    def block_table(self, key: str) -> list[int]:
        """The sequence's physical block ids in logical order (a copy; empty when it owns none)."""
        return list(self._tables.get(key, ()))

    def slot_mapping(self, key: str, start: int, n: int) -> list[int]:
        """Physical KV slots of positions start..start+n-1.

        Raises:
            ValueError: the positions are not all covered by the sequence's blocks (call append_slots first).
        """
        table = self._tables.get(key, [])
        bs = self.block_size
        if start < 0 or n < 0 or start + n > len(table) * bs:
            raise ValueError(
                f"positions {start}..{start + n - 1} of sequence {key!r} are outside its "
                f"{len(table)} blocks ({len(table) * bs} slots); call append_slots first"
            )
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]
