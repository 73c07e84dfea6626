"""Pure engine parts: incremental detokenizer with stop strings, and the scheduler's batching rules over llama.cpp's
slot ledger (the paged ledger has its own tests, in test_kv_paged.py)."""

from __future__ import annotations

import pytest

from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.runner import CopyKV, DropKV
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence, SequenceStatus
from quantserve.engine.kv import MIN_COPY_GAIN, PACK_MIN_PREFIX_GAIN, PagedKV, SlotKV
from quantserve.engine.scheduler import Scheduler, SchedulerConfig
from quantserve.errors import InvalidRequestError


def _feed(det: IncrementalDetokenizer, pieces: list[bytes]) -> tuple[str, bool]:
    out, stopped = "", False
    for p in pieces:
        text, stopped = det.add(p)
        out += text
        if stopped:
            return out, True
    return out + det.flush(), False


@pytest.mark.parametrize(
    ("pieces", "stop", "expected", "stopped"),
    [
        ([b"Hello", b" wor", b"ld"], (), "Hello world", False),
        ([b"1, 2,", b" 3", b", 4"], (", 4",), "1, 2, 3", True),  # stop split across tokens
        ([b"ab", b"c", b"d"], ("cd",), "ab", True),
        ([b"ab", b"c", b"x"], ("cd",), "abcx", False),  # held back, then released
        ([b"x<", b"/s", b">tail"], ("</s>",), "x", True),
        ([b"caf", b"\xc3", b"\xa9!"], (), "café!", False),  # UTF-8 split across tokens
        ([b"aaa"], ("aab", "b"), "aaa", False),
        ([b"xSTOPy"], ("STOP",), "x", True),
        ([b"END"], ("ND", "END"), "", True),  # earliest match wins
    ],
)
def test_detokenizer(pieces, stop, expected, stopped):
    assert _feed(IncrementalDetokenizer(stop), pieces) == (expected, stopped)


def test_detokenizer_never_emits_a_stop_prefix_early():
    det = IncrementalDetokenizer(("STOP",))
    assert det.add(b"abc ST") == ("abc ", False)
    assert det.add(b"O") == ("", False)
    assert det.add(b"P more") == ("", True)


def test_sampling_params_validation_names_the_field():
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(temperature=3.0)
    assert exc.value.param == "temperature"
    with pytest.raises(InvalidRequestError):
        SamplingParams(stop=("",))


def _seq(rid: str, n_prompt: int) -> Sequence:
    p = SamplingParams(max_tokens=100)
    return Sequence(rid, list(range(n_prompt)), p, IncrementalDetokenizer(), max_total_tokens=10_000)


def _sched(seqs: int, batch: int, cells: int, *, caching=False, shared=True, pack=False) -> Scheduler:
    kv = SlotKV(seqs, cells, shared=shared, prefix_caching=caching, pack=pack)
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=batch, max_queue_len=8), kv)


def _slot(seq: Sequence) -> int:
    return seq.block_table[0]


def _run(sched: Scheduler, plan):
    """Pretend the model computed the plan and sampled one token for every sequence that finished its chunk."""
    for seq, n in plan:
        seq.num_computed += n
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(0)


def test_chunked_prefill_interleaves_with_decode():
    sched = _sched(4, 16, 1000)
    a = _seq("a", 4)
    sched.add(a)
    plan = sched.schedule().plan
    assert [(s.request_id, n) for s, n in plan] == [("a", 4)]
    _run(sched, plan)
    long = _seq("long", 40)
    sched.add(long)
    plan = sched.schedule().plan
    # a decodes one token; the long prompt only gets the rest of the 16-token budget
    assert [(s.request_id, n) for s, n in plan] == [("a", 1), ("long", 15)]
    _run(sched, plan)
    plan = sched.schedule().plan
    assert [(s.request_id, n) for s, n in plan] == [("a", 1), ("long", 15)]


def test_slots_limit_admission_and_are_reused():
    sched = _sched(2, 64, 1000)
    seqs = [_seq(str(i), 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule().plan
    assert [s.request_id for s, _ in plan] == ["0", "1"]
    assert {_slot(seqs[0]), _slot(seqs[1])} == {0, 1}
    assert seqs[2].status is SequenceStatus.WAITING
    freed = _slot(seqs[0])
    sched.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    _run(sched, plan)
    plan = sched.schedule().plan
    assert _slot(seqs[2]) == freed
    assert [s.request_id for s, _ in plan] == ["1", "2"]


def test_kv_pressure_preempts_newest_and_recomputes():
    sched = _sched(4, 64, 10)
    a, b = _seq("a", 4), _seq("b", 4)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule().plan
    _run(sched, plan)  # 8 cells used, each has 1 token to decode
    sch = sched.schedule()
    plan, pre = sch.plan, sch.preempted
    _run(sched, plan)  # 10 cells used
    sch = sched.schedule()
    plan, pre = sch.plan, sch.preempted  # no room for 2 more tokens: b is preempted
    assert pre == [b] and b.num_computed == 0 and b.status is SequenceStatus.WAITING
    assert [(s.request_id, n) for s, n in plan] == [("a", 1)]
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    plan = sched.schedule().plan
    assert [(s.request_id, n) for s, n in plan] == [("b", 6)]  # prompt + its 2 generated tokens


def test_waiting_sequence_is_not_admitted_without_kv_room():
    sched = _sched(4, 64, 12)
    a, b = _seq("a", 8), _seq("b", 8)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule().plan
    assert [s.request_id for s, _ in plan] == ["a"]
    assert b.status is SequenceStatus.WAITING


def _finish_all(sched: Scheduler) -> None:
    for seq in list(sched.running):
        sched.finish(seq, SequenceStatus.FINISHED_STOPPED)


def test_prefix_cache_reuses_the_slot_with_the_longest_common_prefix():
    sched = _sched(2, 64, 100, caching=True)
    system = list(range(100, 120))
    a, b = _seq("a", 0), _seq("b", 0)
    a.tokens, b.tokens = system + [1, 2, 3], [7, 8, 9]
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule().plan)
    slot_a = _slot(a)
    _finish_all(sched)
    assert sched.kv.slot_tokens[slot_a] == system + [1, 2, 3]  # prompt only: the sampled token was never fed
    c = _seq("c", 0)
    c.tokens = system + [4, 5]
    sched.add(c)
    s = sched.schedule()
    assert s.admitted == [c] and _slot(c) == slot_a and c.num_computed == len(system)
    assert [(q.request_id, n) for q, n in s.plan] == [("c", 2)]  # only the new suffix is computed
    assert s.kv_ops == [DropKV(slot_a, len(system))]  # the slot's cache past the shared prefix goes


def test_per_sequence_kv_copies_a_shared_prefix_into_other_slots():
    """A rerank request's documents: the first computes the long shared prefix alone, then the rest start together
    in several slots. One reuses that slot's cache; the others get its prefix copied in (from a running slot too),
    and compute only their own tokens."""
    sched = _sched(4, 256, 4 * 64, caching=True, shared=False, pack=True)
    prefix = list(range(100, 100 + MIN_COPY_GAIN + 8))
    first = _seq("first", 0)
    first.tokens = prefix + [1, 2]
    sched.add(first)
    _run(sched, sched.schedule().plan)
    _finish_all(sched)
    docs = [_seq(f"d{i}", 0) for i in range(3)]
    for i, d in enumerate(docs):
        d.tokens = prefix + [10 + i, 20 + i]
        sched.add(d)
    s = sched.schedule()
    assert s.admitted == docs and all(d.num_computed == len(prefix) for d in docs)
    assert [(q.request_id, n) for q, n in s.plan] == [("d0", 2), ("d1", 2), ("d2", 2)]
    slot0 = _slot(docs[0])
    assert s.kv_ops == [DropKV(slot0, len(prefix))] + [CopyKV(slot0, _slot(d), len(prefix)) for d in docs[1:]]


def test_a_prefix_shorter_than_the_copy_gain_is_computed_again():
    sched = _sched(2, 256, 2 * 64, caching=True, shared=False, pack=True)
    prefix = list(range(100, 100 + MIN_COPY_GAIN - 1))
    a, b = _seq("a", 0), _seq("b", 0)
    a.tokens, b.tokens = prefix + [1], prefix + [2]
    sched.add(a)
    _run(sched, sched.schedule().plan)
    sched.add(b)  # a is still running: its slot holds the prefix, too short to be worth a copy
    s = sched.schedule()
    assert s.admitted == [b] and b.num_computed == 0 and s.kv_ops == []


def test_the_unified_pool_never_copies():
    sched = _sched(2, 256, 200, caching=True, shared=True, pack=True)
    prefix = list(range(100, 100 + 2 * MIN_COPY_GAIN))
    a, b = _seq("a", 0), _seq("b", 0)
    a.tokens, b.tokens = prefix + [1], prefix + [2]
    sched.add(a)
    _run(sched, sched.schedule().plan)
    sched.add(b)
    s = sched.schedule()
    assert s.admitted == [b] and b.num_computed == 0 and not any(isinstance(op, CopyKV) for op in s.kv_ops)


def test_prefix_cache_always_recomputes_the_last_prompt_token():
    sched = _sched(1, 64, 100, caching=True)
    a = _seq("a", 6)
    sched.add(a)
    _run(sched, sched.schedule().plan)
    _finish_all(sched)
    again = _seq("again", 6)  # the very same prompt
    sched.add(again)
    s = sched.schedule()
    assert again.num_computed == 5 and [(q.request_id, n) for q, n in s.plan] == [("again", 1)]


def test_shared_pool_evicts_oldest_cached_prefix_when_cells_are_needed():
    sched = _sched(3, 64, 20, caching=True, shared=True)
    a, b = _seq("a", 8), _seq("b", 8)
    a.tokens, b.tokens = [1] * 8, [2] * 8
    for s in (a, b):
        sched.add(s)
    _run(sched, sched.schedule().plan)
    slot_a, slot_b = _slot(a), _slot(b)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)  # cached first: evicted first
    sched.finish(b, SequenceStatus.FINISHED_STOPPED)
    assert sched.kv.num_cached == 16
    c = _seq("c", 10)
    c.tokens = [3] * 10  # shares nothing: takes the empty slot, and needs 10 of the 4 free cells
    sched.add(c)
    s = sched.schedule()
    assert s.admitted == [c] and _slot(c) not in (slot_a, slot_b) and s.kv_ops == [DropKV(slot_a)]
    assert list(sched.kv.slot_tokens) == [slot_b] and sched.kv.num_used + sched.kv.num_cached <= 20


def test_per_sequence_kv_does_not_count_cached_prefixes_against_the_pool():
    sched = _sched(2, 64, 20, caching=True, shared=False)
    a = _seq("a", 10)
    sched.add(a)
    _run(sched, sched.schedule().plan)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    b = _seq("b", 10)
    b.tokens = [9] * 10
    sched.add(b)
    s = sched.schedule()
    assert s.admitted == [b] and s.kv_ops == []  # its own slot's cells: nothing to evict


def test_paged_ledger_never_plans_more_blocks_than_exist():
    """16-token blocks, 4 of them: a decoding sequence at a block boundary plus two admissions must fit the pool;
    the ledger raises if the scheduler ever asks it for a block it does not have."""
    kv = PagedKV(4, 16, prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_queue_len=8), kv)
    a = _seq("a", 16)
    sched.add(a)
    for i in range(40):
        if i == 1:  # a now decodes at a block boundary; b and c arrive
            for rid, n in (("b", 16), ("c", 32)):
                sched.add(_seq(rid, n))
        step = sched.schedule()
        for seq, n in step.plan:
            assert len(seq.block_table) * 16 >= seq.num_computed + n  # the batch's K/V have somewhere to go
            seq.num_computed += n
            if seq.num_uncomputed == 0:
                seq.tokens.append(1)
        for seq in [s for s in sched.running if len(s.tokens) >= 40]:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        if not sched.has_work():
            break
    assert not sched.has_work() and kv.num_free_blocks == 4


def _packing_scheduler(max_num_seqs: int) -> Scheduler:
    return _sched(max_num_seqs, 4096, max_num_seqs * 1000, caching=True, shared=False, pack=True)


def test_packed_slots_prefer_the_lowest_free_slot_over_a_short_cached_prefix():
    """llama.cpp computes each run of consecutive seq ids as its own weight pass, so a new sequence fills the
    lowest free slot rather than a higher one that only shares a chat template's head."""
    sched = _packing_scheduler(4)
    system = list(range(100, 130))
    seqs = [_seq(str(i), 0) for i in range(4)]
    for i, s in enumerate(seqs):
        s.tokens = system + [i] * 5
        sched.add(s)
    _run(sched, sched.schedule().plan)
    assert [_slot(s) for s in seqs] == [0, 1, 2, 3]
    for s in seqs[1:]:  # 1..3 finish; 0 keeps running
        sched.finish(s, SequenceStatus.FINISHED_STOPPED)
    new = _seq("new", 0)
    new.tokens = system + [3] * 5  # slot 3 holds 34 reusable tokens, slot 1 holds 30
    sched.add(new)
    sched.schedule()
    assert _slot(new) == 1 and new.num_computed == len(system)  # slot 1's shared head is still reused


@pytest.mark.parametrize(("extra", "slot"), [(PACK_MIN_PREFIX_GAIN - 1, 0), (PACK_MIN_PREFIX_GAIN, 1)])
def test_packing_gives_way_at_exactly_the_minimum_prefix_gain(extra, slot):
    sched = _packing_scheduler(2)
    a, b = _seq("a", 0), _seq("b", 0)
    a.tokens, b.tokens = [1] * 10, [2] * extra
    for s in (a, b):
        sched.add(s)
    _run(sched, sched.schedule().plan)
    _finish_all(sched)
    new = _seq("new", 0)
    new.tokens = [2] * extra + [5]  # can reuse `extra` tokens of slot 1, none of slot 0
    sched.add(new)
    sched.schedule()
    assert _slot(new) == slot


def test_packed_slots_still_return_a_long_conversation_to_its_own_slot():
    sched = _packing_scheduler(3)
    a, b, c = _seq("a", 0), _seq("b", 0), _seq("c", 0)
    a.tokens, b.tokens, c.tokens = [1] * 10, [2] * 10, [3] * 400
    for s in (a, b, c):
        sched.add(s)
    _run(sched, sched.schedule().plan)
    assert _slot(c) == 2
    for s in (b, c):
        sched.finish(s, SequenceStatus.FINISHED_STOPPED)
    turn2 = _seq("turn2", 0)
    turn2.tokens = [3] * 400 + [4] * 20  # the conversation goes on: 400 cached tokens are worth a gap
    sched.add(turn2)
    sched.schedule()
    assert _slot(turn2) == 2 and turn2.num_computed == 400
