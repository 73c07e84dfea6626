"""The torch backend under the engine, on the real SmolLM2 (fp32, CPU): batched greedy = alone, preemption and
cancellation leak no KV blocks, and the Paris answer through the library API."""

from __future__ import annotations

import asyncio

import pytest
import torch

from quantserve.backends.torch.runner import TorchRunner, TorchSettings
from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.backends.torch.weights import load_model
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
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


def make_engine(model_and_tokenizer, max_num_seqs: int, kv_tokens: int, n_batch: int = 64):
    model, tok = model_and_tokenizer
    runner = TorchRunner(
        model, tok, TorchSettings(n_ctx=min(kv_tokens, 512), max_num_seqs=max_num_seqs, num_kv_tokens=kv_tokens),
        torch.device("cpu"),
    )  # fmt: skip
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=n_batch, max_queue_len=64)
    return LLMEngine(runner, config, make_kv(runner.kv_spec, prefix_caching=False)), runner


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
        mlp = llm.runner.model.model.layers[0].mlp
        # group 128 where K allows it (1536), 64 where it does not (576 = 4.5 x 128)
        assert isinstance(mlp.down_proj, QuantLinear)
        assert (mlp.down_proj.group_size, mlp.up_proj.group_size) == (128, 64)
        assert "Paris" in greedy_chat(llm, 12)
    finally:
        llm.close()
