"""The engine's KV ledger: which cache blocks each sequence holds, what stays cached for a later prompt with the same
prefix, and whether there is room. One ledger per model, owned by the scheduler; a runner only reads the block
tables it hands out (`seq.block_table`) and drops or copies the cached KV as it says (`take_ops`).

Two layouts (quantserve.core.runner.KVSpec): `PagedKV` (paged.py) for the torch backend's block pool, with
automatic prefix caching by hashed blocks; `SlotKV` (slots.py) for llama.cpp's sequence slots, with its prefix cache
by slot.
"""

from __future__ import annotations

from typing import Protocol

from quantserve.core.runner import CopyKV, DropKV, KVSpec
from quantserve.core.sequence import Sequence
from quantserve.engine.kv.paged import PagedKV
from quantserve.engine.kv.slots import MIN_COPY_GAIN, PACK_MIN_PREFIX_GAIN, SlotKV


class KVManager(Protocol):
    """The ledger's contract with the scheduler. Counts are in tokens (whole blocks)."""

    num_used: int  # held by running sequences
    num_cached: int  # held for reuse only

    def can_allocate(self, seq: Sequence) -> bool:
        """Room for all of seq.tokens, less the prefix already cached (admission takes whole prompts, so that
        prefills do not thrash)."""
        ...

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` its block table for all of its tokens; set num_computed to the cached prefix it reuses
        (never its last token: its logits are needed)."""
        ...

    def can_append(self, seq: Sequence) -> bool:
        """Room for the token the sequence just sampled."""
        ...

    def append(self, seq: Sequence) -> None:
        """Extend its block table to hold all of seq.tokens."""
        ...

    def deallocate(self, seq: Sequence) -> None:
        """Take its blocks back; with prefix caching, its computed KV stays cached until the room is needed."""
        ...

    def take_ops(self) -> list[DropKV | CopyKV]:
        """Cached KV the runner must drop, or copy between slots, before the next step, in order (and forget)."""
        ...


def make_kv(spec: KVSpec, *, prefix_caching: bool) -> KVManager:
    """The ledger for a runner's cache; `prefix_caching` only where the runner allows it."""
    caching = prefix_caching and spec.prefix_cache
    if spec.layout == "paged":
        return PagedKV(spec.num_blocks, spec.block_size, prefix_caching=caching, state_slots=spec.state_slots)
    return SlotKV(
        spec.num_slots, spec.cells, shared=spec.shared, prefix_caching=caching, pack=spec.pack_slots,
        window=spec.window,
    )  # fmt: skip


__all__ = ["MIN_COPY_GAIN", "PACK_MIN_PREFIX_GAIN", "KVManager", "PagedKV", "SlotKV", "make_kv"]
