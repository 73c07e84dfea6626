"""BlockManager: block counting, slot mapping, exhaustion, and no leaks over random alloc/append/free cycles."""

from __future__ import annotations

import random

import pytest

from quantserve.backends import KVCacheFull
from quantserve.backends.torch.block_manager import BlockManager, NoFreeBlocks


def test_allocate_append_deallocate_counts_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.num_free_blocks == 10 and bm.can_allocate(40) and not bm.can_allocate(41)
    bm.allocate("a", 5)  # 2 blocks
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 2 and bm.num_tokens_capacity("a") == 8
    bm.append_slots("a", 8)  # still fits
    assert bm.num_free_blocks == 8
    bm.append_slots("a", 9)  # one more block
    assert bm.num_free_blocks == 7 and len(bm.block_table("a")) == 3
    bm.append_slots("b", 1)  # a first append starts a table
    assert bm.num_free_blocks == 6 and len(bm.block_table("b")) == 1
    bm.append_slots("a", 3)  # shrinking requests never free anything
    assert bm.num_free_blocks == 6
    bm.deallocate("a")
    assert bm.num_free_blocks == 9 and bm.block_table("a") == []
    bm.deallocate("b")
    assert bm.num_free_blocks == 10


def test_blocks_are_distinct_across_sequences():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", 5)
    bm.allocate("b", 6)
    ta, tb = bm.block_table("a"), bm.block_table("b")
    assert len(ta) == 3 and len(tb) == 3 and not set(ta) & set(tb)
    assert set(ta + tb) <= set(range(8)) and bm.num_free_blocks == 2


def test_slot_mapping_follows_block_table():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("x", 1)
    bm.allocate("y", 4)  # interleave so x's blocks are not contiguous
    bm.append_slots("x", 10)
    table = bm.block_table("x")
    assert len(table) == 3
    slots = bm.slot_mapping("x", 0, 10)
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(10)]
    assert bm.slot_mapping("x", 6, 3) == slots[6:9]
    assert bm.slot_mapping("x", 5, 0) == []
    # every slot of every sequence is distinct and inside the cache
    all_slots = slots + bm.slot_mapping("y", 0, 4)
    assert len(set(all_slots)) == len(all_slots) and all(0 <= s < 6 * 4 for s in all_slots)
    with pytest.raises(ValueError, match="append_slots"):
        bm.slot_mapping("x", 10, 3)  # capacity is 12
    with pytest.raises(ValueError):
        bm.slot_mapping("nobody", 0, 1)


def test_exhausting_blocks_raises_and_allocates_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    assert not bm.can_append("a", 13) and bm.can_append("a", 12)
    with pytest.raises(NoFreeBlocks, match="needs 2 more KV blocks for 13 tokens but only 1 of 3") as e:
        bm.append_slots("a", 13)
    assert isinstance(e.value, KVCacheFull)  # the engine preempts on this type
    assert bm.num_free_blocks == 1 and len(bm.block_table("a")) == 2  # all or nothing
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", 5)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 1
    with pytest.raises(ValueError, match="already owns"):
        bm.allocate("a", 1)


def test_deallocate_twice_or_unknown_is_harmless():
    bm = BlockManager(num_blocks=4, block_size=8)
    bm.allocate("a", 20)
    bm.deallocate("a")
    bm.deallocate("a")
    bm.deallocate("never-seen")
    assert bm.num_free_blocks == 4
    bm.allocate("a", 32)  # the key can be reused afterwards
    assert bm.num_free_blocks == 0


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_no_leak_over_random_cycles():
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=64, block_size=16)
    lengths: dict[str, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.3 or not lengths:
            key, n = f"s{step}", rng.randint(1, 200)
            if bm.can_allocate(n):
                bm.allocate(key, n)
                lengths[key] = n
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.allocate(key, n)
        elif op < 0.8:
            key = rng.choice(sorted(lengths))
            n = lengths[key] + rng.randint(1, 40)
            if bm.can_append(key, n):
                bm.append_slots(key, n)
                lengths[key] = n
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.append_slots(key, n)
        else:
            key = rng.choice(sorted(lengths))
            bm.deallocate(key)
            del lengths[key]
        owned = [b for k in lengths for b in bm.block_table(k)]
        assert len(owned) == len(set(owned)) == bm.num_used_blocks
        assert all(len(bm.block_table(k)) == bm.num_blocks_for(n) for k, n in lengths.items())
    for key in list(lengths):
        bm.deallocate(key)
    assert bm.num_free_blocks == bm.num_blocks == 64
