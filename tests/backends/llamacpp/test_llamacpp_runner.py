"""LlamaCppRunner on the real SmolLM2 GGUF: how a step's batch is laid out, and that the layout changes no token."""

from __future__ import annotations

import pytest

from quantserve.backends.llamacpp.model import LlamaCppRunner
from quantserve.backends.llamacpp.sampler import SamplerChain
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.runner import CopyKV, DropKV
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.core.settings import EngineSettings
from tests.conftest import THREADS

PROMPTS = ["The capital of France is", "Once upon a time, a dragon", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module", params=["auto", "off"], ids=["flash-attn-auto", "flash-attn-off"])
def runner(smollm2_gguf, request):
    settings = EngineSettings.from_options(
        ctx_size=256, max_num_seqs=4, threads=THREADS, flash_attn=request.param
    )
    r = LlamaCppRunner(smollm2_gguf, settings)
    yield r
    r.close()


def _greedy(runner, placed: list[tuple[int, int]], steps: int) -> list[list[int]]:
    """Run (prompt index, slot) pairs together, in that plan order: one batch prefills every prompt, then each
    step decodes them all. Returns each sequence's greedy tokens."""
    seqs = []
    for i, slot in placed:
        toks = runner.tokenize(PROMPTS[i], add_special=True, parse_special=False)
        params = SamplingParams(temperature=0.0, max_tokens=steps)
        seq = Sequence(str(i), toks, params, IncrementalDetokenizer(), max_total_tokens=256)
        seq.block_table = [slot]  # the engine's ledger would give it this slot
        seqs.append(seq)
    for _ in range(steps):
        results = runner.execute([(s, s.num_uncomputed) for s in seqs])
        ids = [runner.batch.seq_id[i][0] for i in range(runner.batch.n_tokens)]
        assert ids == sorted(ids), f"batch not in seq id order: {ids}"
        for seq, r in zip(seqs, results, strict=True):
            _step(seq, r)
    for s in seqs:
        runner.release(s)
    runner.drop_kv([DropKV(slot) for _, slot in placed])
    return [s.output_tokens for s in seqs]


def _step(seq: Sequence, r) -> None:
    """What the engine does after a step: every token is in the cache now (the scheduler's postprocess), and the
    sampled one is appended."""
    seq.num_computed = len(seq.tokens)
    seq.tokens.append(r.token)


def test_batch_is_written_in_seq_id_order_and_results_come_back_in_plan_order(runner):
    """llama.cpp splits a per-sequence-KV batch into one weight pass per run of consecutive, increasing seq ids,
    in batch order, so the runner writes the batch sorted by seq id. Batched in a scrambled plan order, every
    sequence must still get exactly the tokens it gets alone, and no KV may be left behind."""
    alone = [_greedy(runner, [(i, 3)], 12)[0] for i in range(len(PROMPTS))]
    assert len({tuple(t) for t in alone}) == len(PROMPTS)  # distinct answers: a mix-up would show
    assert _greedy(runner, [(0, 2), (1, 0), (2, 3), (3, 1)], 12) == alone
    assert runner.num_kv_used() == 0


def _continue(runner, tokens: list[int], slot: int, computed: int, steps: int) -> list[int]:
    """Greedy tokens of a sequence in `slot` whose first `computed` tokens are taken as already in its KV."""
    seq = Sequence("c", list(tokens), SamplingParams(temperature=0.0, max_tokens=steps), IncrementalDetokenizer(),
                   max_total_tokens=256)  # fmt: skip
    seq.block_table, seq.num_computed = [slot], computed
    for _ in range(steps):
        (r,) = runner.execute([(seq, seq.num_uncomputed)])
        _step(seq, r)
    runner.release(seq)
    return seq.output_tokens


def test_a_prefix_copied_into_another_slot_serves_as_if_computed_there(runner):
    """CopyKV, as the ledger sends it: slot 0's KV is copied into slot 2 and cut to the prompt less its last
    token, then slot 0 is emptied before the next decode (llama.cpp copies the stream's buffer at that decode).
    Slot 2 then gives the tokens a fresh run gives; an empty slot told the same would not."""
    tokens = runner.tokenize(PROMPTS[0] + " a city that", add_special=True, parse_special=False)
    fresh = _continue(runner, tokens, 0, 0, 10)
    runner.drop_kv([CopyKV(0, 2, len(tokens) - 1), DropKV(0)])
    assert _continue(runner, tokens, 2, len(tokens) - 1, 10) == fresh
    assert _continue(runner, tokens, 3, len(tokens) - 1, 10) != fresh  # the test can fail: no copy, no prefix
    runner.drop_kv([DropKV(2), DropKV(3)])
    assert runner.num_kv_used() == 0


def _generate(runner, prompt: str, params: SamplingParams, steps: int) -> list[int]:
    toks = runner.tokenize(prompt, add_special=True, parse_special=False)
    seq = Sequence("g", toks, params, IncrementalDetokenizer(), max_total_tokens=256)
    seq.block_table = [0]
    for _ in range(steps):
        (r,) = runner.execute([(seq, seq.num_uncomputed)])
        _step(seq, r)
    runner.release(seq)
    runner.drop_kv([DropKV(0)])
    return seq.output_tokens


def test_plain_greedy_argmax_equals_llama_cpp_greedy_sampler(runner):
    """Plain greedy skips llama.cpp's sampler chain (an argmax in numpy); a zero logit bias forces the chain
    (logit bias → greedy) without changing any logit. Both must pick the same tokens."""
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    chained = SamplingParams(temperature=0.0, max_tokens=24, logit_bias=((0, 0.0),))
    for params, expected in ((plain, True), (chained, False)):
        chain = SamplerChain(runner.vocab, runner.n_vocab, params)
        assert chain.plain_greedy is expected
        chain.close()
    for prompt in PROMPTS:
        assert _generate(runner, prompt, plain, 24) == _generate(runner, prompt, chained, 24)
