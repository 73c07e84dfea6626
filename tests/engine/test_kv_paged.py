"""PagedKV, the engine's ledger of the torch backend's paged cache: block counting, addressing, exhaustion, no leaks
over random cycles, and automatic prefix caching (hashed full blocks, shared by reference count, least recently
freed first out)."""

from __future__ import annotations

import random

import pytest

from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.engine.kv import PagedKV


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=100), IncrementalDetokenizer(), 10_000)


def prefilled(kv: PagedKV, s: Sequence) -> Sequence:
    """Admitted, and its whole prompt computed by a step (the ledger learns of it on the next append)."""
    kv.allocate(s)
    s.num_computed = len(s.tokens)
    kv.append(s)
    return s


def test_allocate_append_deallocate_counts_blocks():
    kv = PagedKV(10, 4)
    a = seq(list(range(5)))
    assert kv.can_allocate(a)
    kv.allocate(a)  # 2 blocks
    assert kv.num_free_blocks == 8 and len(a.block_table) == 2 and a.num_computed == 0
    a.tokens += [5, 6, 7]  # 8 tokens: still fits
    kv.append(a)
    assert kv.num_free_blocks == 8
    a.tokens.append(8)
    assert kv.can_append(a)
    kv.append(a)  # one more block
    assert kv.num_free_blocks == 7 and len(a.block_table) == 3 and kv.num_used == 12
    kv.deallocate(a)
    assert kv.num_free_blocks == 10 and a.block_table == [] and kv.num_used == 0


def test_blocks_are_distinct_and_address_every_token_once():
    kv = PagedKV(8, 2, prefix_caching=False)
    a, b = seq(list(range(5))), seq(list(range(10, 16)))
    kv.allocate(a)
    kv.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 3 and not set(a.block_table) & set(b.block_table)
    slots = [s.block_table[p // 2] * 2 + p % 2 for s in (a, b) for p in range(len(s.tokens))]
    assert len(set(slots)) == len(slots) and all(0 <= x < 16 for x in slots)


def test_exhaustion_is_seen_before_anything_is_taken():
    kv = PagedKV(3, 4, prefix_caching=False)
    a = seq(list(range(8)))
    kv.allocate(a)
    a.tokens += [0] * 4  # 12 tokens: 3 blocks
    assert kv.can_append(a)
    kv.append(a)
    a.tokens.append(0)
    assert not kv.can_append(a) and not kv.can_allocate(seq([1]))
    with pytest.raises(RuntimeError, match="more blocks than it has"):
        kv.append(a)  # only a scheduler bug gets here
    with pytest.raises(ValueError):
        PagedKV(0, 16)


def test_no_leak_over_random_cycles():
    rng = random.Random(1234)
    kv = PagedKV(64, 16)
    live: list[Sequence] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not live:
            s = seq([rng.randrange(4) for _ in range(rng.randint(1, 200))])  # repeats: prefix hits happen
            if kv.can_allocate(s):
                kv.allocate(s)
                live.append(s)
        elif op < 0.8:
            s = rng.choice(live)
            s.num_computed = len(s.tokens)
            s.tokens += [rng.randrange(4) for _ in range(rng.randint(1, 40))]
            if kv.can_append(s):
                kv.append(s)
            else:  # no room: preempted, as the scheduler would
                kv.deallocate(s)
                live.remove(s)
        else:
            kv.deallocate(live.pop(rng.randrange(len(live))))
        refs = [b for s in live for b in s.block_table]
        assert all(kv.ref[b] == refs.count(b) for b in set(refs))  # shared blocks counted once per holder
        assert kv.num_free_blocks + len(set(refs)) == 64
    for s in live:
        kv.deallocate(s)
    assert kv.num_free_blocks == 64 and kv.num_used == 0 and all(r == 0 for r in kv.ref)


# ---- prefix caching -----------------------------------------------------------------------------------


def test_a_second_request_reuses_the_full_blocks_of_a_shared_prefix():
    kv = PagedKV(32, 4)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = prefilled(kv, seq(shared + [1, 2, 3]))
    b = seq(shared + [7])
    kv.allocate(b)
    assert b.num_computed == 8 and b.block_table[:2] == a.block_table[:2]  # the shared full blocks
    assert b.block_table[2] not in a.block_table  # the partial third block is b's own
    assert kv.ref[a.block_table[0]] == 2 and kv.hits == 8
    kv.deallocate(a)
    kv.deallocate(b)
    assert kv.num_used == 0 and kv.num_cached == 3 * 4  # a's 3 full blocks stay findable
    c = seq(shared + [1, 2, 3, 9])
    kv.allocate(c)
    assert c.num_computed == 12  # finished sequences' blocks are found too


def test_the_last_prompt_token_is_always_computed():
    kv = PagedKV(8, 4)
    kv.deallocate(prefilled(kv, seq(list(range(8)))))
    again = seq(list(range(8)))  # the same two full blocks: the second holds the last token
    kv.allocate(again)
    assert again.num_computed == 4


def test_only_computed_blocks_are_registered():
    kv = PagedKV(8, 4)
    a = seq(list(range(12)))
    kv.allocate(a)
    a.num_computed = 4  # a chunk of the prompt so far
    kv.append(a)
    b = seq(list(range(12)) + [5])
    kv.allocate(b)
    assert b.num_computed == 4  # the second and third blocks have no K/V yet


def test_cached_blocks_are_reclaimed_least_recently_freed_first():
    kv = PagedKV(3, 2)
    old, new = prefilled(kv, seq([1, 1])), prefilled(kv, seq([2, 2]))
    kv.deallocate(old)
    kv.deallocate(new)
    assert kv.num_cached == 4
    big = seq([9] * 3)  # 2 blocks: the one never used, then the least recently freed cached one (old's)
    kv.allocate(big)
    assert kv.num_cached == 2
    kv.deallocate(big)
    probe_new, probe_old = seq([2, 2, 5]), seq([1, 1, 5])
    kv.allocate(probe_new)
    kv.deallocate(probe_new)
    kv.allocate(probe_old)
    assert probe_new.num_computed == 2 and probe_old.num_computed == 0


def test_no_block_leaks_when_shared_sequences_are_cancelled():
    kv = PagedKV(16, 4)
    prefix = list(range(40, 52))
    first = prefilled(kv, seq(prefix + [0]))
    others = [seq(prefix + [i]) for i in range(1, 6)]
    for s in others:
        kv.allocate(s)
    assert kv.ref[first.block_table[0]] == 6
    for s in [first, *others]:  # cancelled, in any order
        kv.deallocate(s)
    assert kv.num_used == 0 and all(r == 0 for r in kv.ref) and kv.num_free_blocks == 16


def _image(data: bytes):
    import numpy as np

    from quantserve.core.multimodal import Image

    return Image(data, np.zeros((2, 2, 3), dtype=np.uint8))


def with_image(image, n_text_before: int = 3, n_image: int = 10, n_after: int = 5) -> Sequence:
    """A prompt of text, an image's placeholder tokens (all 99), then text."""
    from quantserve.core.multimodal import ImageSpan

    tokens = list(range(1, n_text_before + 1)) + [99] * n_image + list(range(50, 50 + n_after))
    s = seq(tokens)
    s.images = [ImageSpan(n_text_before, n_image, image)]
    return s


def test_prefix_cache_keys_image_positions_on_the_image_bytes():
    kv = PagedKV(20, 4)
    first = prefilled(kv, with_image(_image(b"cat")))
    kv.deallocate(first)
    other = with_image(_image(b"dog"))  # same tokens, another image
    kv.allocate(other)
    assert (
        other.num_computed == 0
    )  # only block 0 holds text alone, and it ends inside the image: no full block before
    kv.deallocate(other)
    again = with_image(_image(b"cat"))
    kv.allocate(again)
    assert again.num_computed == 16  # every full block before the last token: the same image's KV


def test_slot_prefix_cache_never_reuses_part_of_an_image():
    from quantserve.engine.kv import SlotKV

    kv = SlotKV(1, 64, shared=False, prefix_caching=True)
    cat = _image(b"cat")
    first = with_image(cat)
    kv.allocate(first)
    first.num_computed = 8  # cancelled in the middle of its image's positions
    kv.deallocate(first)
    again = with_image(cat)
    kv.allocate(again)
    assert again.num_computed == 3  # the text before the image; libmtmd's image is decoded whole
    kv.deallocate(again)
    other = with_image(_image(b"dog"))
    kv.allocate(other)
    assert other.num_computed == 3


def test_slot_prefix_cache_with_a_window_reuses_only_what_the_windowed_layers_kept():
    """llama.cpp's sliding-window layers (swa_full off) keep a slot's last `window` positions: a prefix is reused
    when the next prompt continues everything the slot computed, or when nothing was dropped yet; a shorter match
    after more than a window of tokens is recomputed from 0 (and a second slot's copy follows the same rule)."""
    from quantserve.engine.kv import SlotKV

    def after(kv: SlotKV, tokens: list[int], computed: int) -> Sequence:
        s = seq(tokens)
        kv.allocate(s)
        s.num_computed = computed
        kv.deallocate(s)
        return s

    kv = SlotKV(1, 256, shared=False, prefix_caching=True, window=8)
    turn = list(range(20))
    after(kv, turn, 20)
    nxt = seq(turn + [100, 101])  # the chat's next turn: every computed position is a prefix
    kv.allocate(nxt)
    assert nxt.num_computed == 20
    kv.deallocate(nxt)
    edit = seq(turn[:15] + [7, 7, 7])  # shares 15 tokens, but positions 0..13 left the windowed layers
    kv.allocate(edit)
    assert edit.num_computed == 0 and kv.take_ops()[-1].start == 0
    kv.deallocate(edit)
    short = SlotKV(1, 256, shared=False, prefix_caching=True, window=8)
    after(short, turn[:7], 7)  # 7 positions < the window: nothing was dropped
    s = seq(turn[:4] + [9, 9])
    short.allocate(s)
    assert s.num_computed == 4
    full = SlotKV(1, 256, shared=False, prefix_caching=True)  # no window: any common prefix
    after(full, turn, 20)
    s = seq(turn[:15] + [7, 7, 7])
    full.allocate(s)
    assert s.num_computed == 15
    pool = SlotKV(
        2, 512, shared=True, prefix_caching=True, window=8
    )  # the unified pool: others take cells too
    after(pool, turn, 20)
    same = seq(turn)  # n = 19 = the last computed position: its key 12 may be gone in a shared pool
    pool.allocate(same)
    assert same.num_computed == 0
    pool.deallocate(same)
    after(pool, turn, 20)
    s = seq(turn + [100])
    pool.allocate(s)
    assert s.num_computed == 20
    copies = SlotKV(2, 512, shared=False, prefix_caching=True, window=8)
    running = seq(turn + [50] * 40)
    copies.allocate(running)
    running.num_computed = 60
    later = seq(turn + [60] * 40)  # shares 20 tokens with a slot that went on to 60: not copied
    copies.allocate(later)
    assert later.num_computed == 0 and not any(type(op).__name__ == "CopyKV" for op in copies.take_ops())
