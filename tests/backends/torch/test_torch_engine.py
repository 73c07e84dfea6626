"""The torch backend under the engine, on the real SmolLM2 (fp32, CPU): batched greedy = alone, preemption and
cancellation leak no KV blocks, and the Paris answer through the library API."""

from __future__ import annotations

import asyncio

import pytest
import torch

from quantserve.backends.torch.runner import TorchRunner
from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.backends.torch.weights import load_model
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.core.settings import EngineSettings
from quantserve.engine.kv import make_kv
from quantserve.engine.llm_engine import LLMEngine
from quantserve.engine.scheduler import SchedulerConfig
from quantserve.formats import detect
from tests.conftest import PARIS

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def model_and_tokenizer(smollm2_hf):
    model = load_model(detect(smollm2_hf), dtype=torch.float32, device=torch.device("cpu"))
    return model, HFTokenizer.from_dir(smollm2_hf)


def make_engine(
    model_and_tokenizer, max_num_seqs: int, kv_tokens: int, n_batch: int = 64, caching=False, n_ctx=512,
    device: torch.device | None = None,
):  # fmt: skip
    model, tok = model_and_tokenizer
    runner = TorchRunner(
        model, tok, EngineSettings(ctx_size=min(kv_tokens, n_ctx), max_num_seqs=max_num_seqs, kv_size=kv_tokens),
        device or torch.device("cpu"),
    )  # fmt: skip
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=n_batch, max_queue_len=64)
    return LLMEngine(runner, config, make_kv(runner.kv_spec, prefix_caching=caching)), runner


def run(engine: LLMEngine, runner: TorchRunner, prompts: list[str], max_tokens: int = 20, **params):
    texts = {}
    for i, p in enumerate(prompts):
        ids = runner.tokenize(p, add_special=True, parse_special=False)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
        engine.add(Sequence(str(i), ids, sp, IncrementalDetokenizer(), max_total_tokens=runner.n_ctx))
        texts[str(i)] = []
    while engine.has_work():
        for out in engine.step():
            texts[out.request_id].extend(out.token_ids)
    return [texts[str(i)] for i in range(len(prompts))]


def test_batched_greedy_equals_alone(model_and_tokenizer):
    alone = []
    for p in PROMPTS:
        engine, runner = make_engine(model_and_tokenizer, max_num_seqs=1, kv_tokens=512)
        alone += run(engine, runner, [p])
    engine, runner = make_engine(model_and_tokenizer, max_num_seqs=4, kv_tokens=2048, n_batch=16)
    batched = run(engine, runner, PROMPTS)  # 5 prompts, 4 slots: one waits; prefill chunks mix with decode
    assert all(len(t) == 20 for t in batched)
    assert batched == alone
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_preemption_recomputes_and_leaks_no_blocks(model_and_tokenizer):
    engine, runner = make_engine(model_and_tokenizer, max_num_seqs=4, kv_tokens=64)  # 4 blocks of 16
    alone_engine, alone_runner = make_engine(model_and_tokenizer, max_num_seqs=1, kv_tokens=512)
    prompts = PROMPTS[:3]
    preempted = []
    orig = engine.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        return orig(seq)

    engine.scheduler._preempt = spy
    got = run(engine, runner, prompts, max_tokens=24)
    assert preempted, "the KV pool was meant to run out"
    assert got == [run(alone_engine, alone_runner, [p], max_tokens=24)[0] for p in prompts]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_cancel_frees_blocks(model_and_tokenizer):
    engine, runner = make_engine(model_and_tokenizer, max_num_seqs=2, kv_tokens=512)
    for i, p in enumerate(PROMPTS[:2]):
        ids = runner.tokenize(p, add_special=True, parse_special=False)
        engine.add(Sequence(str(i), ids, SamplingParams(max_tokens=100), IncrementalDetokenizer(), 512))
    for _ in range(4):
        engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.abort("0")
    engine.abort("1")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert len(runner.sampler) == 0
    assert run(engine, runner, PROMPTS[:1], max_tokens=4)[0]  # and the engine still works


def run_ids(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = {}
    for i, ids in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add(Sequence(f"p{i}", ids, sp, IncrementalDetokenizer(), max_total_tokens=2048))
        outs[f"p{i}"] = []
        while engine.has_work():
            for out in engine.step():
                outs[out.request_id].extend(out.token_ids)
    return [outs[f"p{i}"] for i in range(len(prompts))]


def test_prefix_cache_computes_only_the_new_tokens_and_changes_no_output(model_and_tokenizer):
    """Two requests share a 1,008-token prefix (63 blocks): the second feeds only its own tokens through the
    model (the runner counts), and gives the tokens it gives on an engine without the cache."""
    from importlib.resources import files

    _, tok = model_and_tokenizer
    text = (files("quantserve") / "data/eval.txt").read_text()
    prefix = tok.tokenize(text, add_special=False, parse_special=False)[:1008]
    first = prefix + tok.tokenize(" What is this text about?", add_special=False, parse_special=False)
    second = prefix + tok.tokenize(" Summarise it in one line:", add_special=False, parse_special=False)
    cached, runner = make_engine(
        model_and_tokenizer, 1, kv_tokens=4096, n_batch=512, caching=True, n_ctx=2048
    )
    run_ids(cached, [first], 8)
    before = runner.tokens_computed
    (with_cache,) = run_ids(cached, [second], 8)
    assert (
        runner.tokens_computed - before == (len(second) - 1008) + 7
    )  # its own prompt tokens, then 7 decodes
    assert cached.kv.hits == 1008
    plain, _ = make_engine(model_and_tokenizer, 1, kv_tokens=4096, n_batch=512, caching=False, n_ctx=2048)
    assert run_ids(plain, [second], 8)[0] == with_cache
    assert cached.kv.num_used == 0 and cached.kv.num_free_blocks == cached.kv.num_blocks


def test_cancelling_requests_that_share_cached_blocks_leaks_none(model_and_tokenizer):
    engine, runner = make_engine(model_and_tokenizer, 4, kv_tokens=1024, caching=True)
    _, tok = model_and_tokenizer
    shared = tok.tokenize("You are a helpful assistant. " * 8, add_special=False, parse_special=False)
    run_ids(engine, [shared + [42]], 2)  # its blocks are now cached
    for i in range(4):
        sp = SamplingParams(max_tokens=50, temperature=0.0)
        engine.add(Sequence(str(i), shared + [i], sp, IncrementalDetokenizer(), max_total_tokens=512))
    engine.step()
    engine.step()
    assert max(engine.kv.ref) == 4  # four running sequences hold the shared blocks
    for i in range(4):
        engine.abort(str(i))
    assert all(r == 0 for r in engine.kv.ref) and engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.num_used == 0 and len(runner.sampler) == 0


def greedy_chat(llm, max_tokens: int) -> str:
    return asyncio.run(_collect(llm.chat(PARIS, temperature=0, max_tokens=max_tokens)))


async def _collect(stream) -> str:
    return "".join([t async for t in stream])


def test_library_chat_answers_paris(smollm2_hf):
    import quantserve

    llm = quantserve.load(str(smollm2_hf), backend="torch", ctx_size=1024, max_num_seqs=2)
    try:
        assert llm.info.backend == "torch"
        assert "Paris" in greedy_chat(llm, 20)
    finally:
        llm.close()


def test_int4_at_load_answers_paris(smollm2_hf):
    """--quant int4: RTN 4-bit at load, repacked to Marlin, run by the CPU W4A16 kernel."""
    import quantserve
    from quantserve.backends.torch.quant_linear import QuantLinear

    llm = quantserve.load(str(smollm2_hf), backend="torch", quant="int4", ctx_size=512, max_num_seqs=1)
    try:
        mlp = llm._runner.model.model.layers[0].mlp  # the loaded weights themselves (gate|up fused at load)
        # group 128 where K allows it (1536), 64 where it does not (576 = 4.5 x 128)
        assert isinstance(mlp.down_proj, QuantLinear) and isinstance(mlp.gate_up_proj, QuantLinear)
        assert (mlp.down_proj.group_size, mlp.gate_up_proj.group_size) == (128, 64)
        assert "Paris" in greedy_chat(llm, 12)
    finally:
        llm.close()
