"""The CUDA half on a GPU (bench/gpu/run.sh runs these with the other `cuda` tests): every W4A16 case of the
interpreter tests compiled for the device, the dequantize kernel, our model against transformers in half
precision, and SmolLM2 GPTQ through the engine: batched greedy decoding against each prompt alone, and CUDA graphs
against eager steps. Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401 - before TRITON_INTERPRET is touched (see tests/kernels/test_w4a16_kernels.py)

from quantserve.kernels.reference import dequantize_marlin
from quantserve.kernels.w4a16_plain import plain_gemm, prepare_plain
from quantserve.kernels.w4a16_triton import TritonW4A16Kernel, marlin_dequantize, prepare_marlin, w4a16_gemm
from tests.backends.torch.test_torch_engine import PROMPTS
from tests.kernels.test_w4a16_kernels import CASES, F16, F32, _sweep, activations, check, make_weight

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def to_cuda(mw):
    return dataclasses.replace(
        mw,
        **{
            f.name: getattr(mw, f.name).cuda()
            for f in dataclasses.fields(mw)
            if torch.is_tensor(getattr(mw, f.name))
        },
    )


@pytest.mark.parametrize("layout", ["plain", "marlin"])
@pytest.mark.parametrize("m,k,n,group,dtype,zp,act,bits", CASES + _sweep())
def test_gemm_case_on_the_device(m, k, n, group, dtype, zp, act, bits, layout):
    """Every interpreter case compiled for the GPU: the K-packed kernel (where the groups suit it, as the
    server runs it: through TritonW4A16Kernel, default configs for this GPU) and the Marlin-layout one."""
    mw = make_weight(k, n, group, bits, zp, act, scale_dtype=F16 if dtype == F32 else dtype)
    x = activations(m, k, dtype)
    bias = torch.randn(n).to(dtype)
    if layout == "plain":
        kernel = TritonW4A16Kernel()
        out = kernel.apply(kernel.prepare(to_cuda(mw)), x.cuda(), bias.cuda()).cpu()
    else:
        out = w4a16_gemm(x.cuda(), prepare_marlin(to_cuda(mw)), bias.cuda()).cpu()
    check(out, x, mw, bias)


@pytest.mark.parametrize("m", [1, 2, 5, 16, 33, 64, 128, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_kernel_on_llama_shapes(m, dtype):
    """The K-packed kernel's default configs on a real layer shape (split-K at small M, big tiles at large M)."""
    mw = make_weight(4096, 1536, 128, scale_dtype=dtype)
    x = activations(m, 4096, dtype)
    state = prepare_plain(to_cuda(mw))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    check(plain_gemm(x.cuda(), state, sm_count=sms).cpu(), x, mw)


@pytest.mark.parametrize(
    "group,zp,act,bits", [(64, True, "random", 4), (-1, False, "gptq", 8), (128, False, None, 4)]
)
def test_dequantize_is_exact_on_the_device(group, zp, act, bits):
    mw = make_weight(512, 256, group, bits, zp, act)
    assert torch.equal(marlin_dequantize(prepare_marlin(to_cuda(mw)), F32).cpu(), dequantize_marlin(mw))


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "qwen3-moe", "mixtral", "phi3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_matches_transformers_on_the_device(case, dtype, tmp_path):
    """Ours in half precision on the GPU against transformers in fp32 on the CPU, same weights."""
    from tests.backends.torch.test_torch_model import tiny_pair

    hf, ours = tiny_pair(case, tmp_path)
    ours = ours.to("cuda", dtype)
    ours.rotary.__init__(ours.args)  # fp32 frequencies, as the loader keeps them
    ours.rotary.to("cuda")
    ours.use_fused_kernels(True)  # the Triton norms and silu * up, as the server runs them
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.compute_logits(ours(ids.cuda())).cpu()
    tol = (8e-3 if dtype == torch.float16 else 3e-2) * want.abs().max().item()
    assert (got - want).abs().max().item() < tol


def staged_gptq() -> Path | None:
    """SmolLM2 GPTQ, unpacked by bench/gpu/run.py from the carried parts (QUANTSERVE_GPU_MODEL)."""
    path = os.environ.get("QUANTSERVE_GPU_MODEL")
    return Path(path) if path and (Path(path) / "config.json").is_file() else None


def generate(llm_parts, prompts: list[str], max_num_seqs: int, graphs: bool, max_tokens: int = 24):
    """Greedy tokens of each prompt through the engine, and per token the gap between the two best logprobs
    (= the gap between the two best logits: near zero, a near-tie)."""
    from quantserve.backends.torch.runner import TorchRunner
    from quantserve.core.detokenizer import IncrementalDetokenizer
    from quantserve.core.sampling_params import SamplingParams
    from quantserve.core.sequence import Sequence
    from quantserve.core.settings import EngineSettings
    from quantserve.engine.kv import make_kv
    from quantserve.engine.llm_engine import LLMEngine
    from quantserve.engine.scheduler import SchedulerConfig

    model, tok = llm_parts
    settings = EngineSettings.from_options(
        ctx_size=512, max_num_seqs=max_num_seqs, kv_size=4096, cuda_graphs=graphs
    )
    runner = TorchRunner(model, tok, settings, torch.device("cuda"))
    assert (runner.graphs is not None) == graphs
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_queue_len=64)
    engine = LLMEngine(runner, config, make_kv(runner.kv_spec, prefix_caching=False))
    texts: dict[str, list[int]] = {}
    gaps: dict[str, list[float]] = {}
    for i, p in enumerate(prompts):
        ids = runner.tokenize(p, add_special=True, parse_special=False)
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2
        )
        engine.add(Sequence(str(i), ids, sp, IncrementalDetokenizer(), max_total_tokens=runner.n_ctx))
        texts[str(i)], gaps[str(i)] = [], []
    while engine.has_work():
        for out in engine.step():
            texts[out.request_id].extend(out.token_ids)
            gaps[out.request_id].extend(lp.top[0][1] - lp.top[1][1] for lp in out.logprobs or [])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [texts[str(i)] for i in range(len(prompts))], [gaps[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def smollm2_gptq_cuda():
    path = staged_gptq()
    if path is None:
        pytest.skip("SmolLM2 GPTQ not staged (bench/gpu/stage.py; QUANTSERVE_GPU_MODEL)")
    from quantserve.backends.torch.fuse import fuse_projections
    from quantserve.backends.torch.tokenizer import HFTokenizer
    from quantserve.backends.torch.weights import load_model
    from quantserve.formats import detect

    model = load_model(detect(path), dtype=torch.float16, device=torch.device("cuda"))
    fuse_projections(model)
    return model, HFTokenizer.from_dir(path)


def test_graphs_give_the_eager_tokens(smollm2_gptq_cuda):
    eager, _ = generate(smollm2_gptq_cuda, PROMPTS, 4, graphs=False)
    graphs, _ = generate(smollm2_gptq_cuda, PROMPTS, 4, graphs=True)
    assert graphs == eager


def test_batched_greedy_equals_alone(smollm2_gptq_cuda):
    """5 prompts, 4 slots (one waits; prefill chunks mix with decodes) against each prompt alone. The W4A16 kernel
    takes another path at M = 1 than at M = 4 (FMAs vs a tensor-core dot: other summation orders, fp16 outputs),
    so the two are not bitwise equal, and a sequence may part where its two best tokens are all but tied: on an
    H100, "def fibonacci(n):" parted at its second token, whose two best logits SmolLM2 GPTQ puts 0.022 apart
    (fp32, CPU). A bug in the batching would part where the choice is clear."""
    alone, gaps = [], []
    for p in PROMPTS:
        tokens, gap = generate(smollm2_gptq_cuda, [p], 1, graphs=True)
        alone.append(tokens[0])
        gaps.append(gap[0])
    batched, _ = generate(smollm2_gptq_cuda, PROMPTS, 4, graphs=True)
    assert all(len(t) == 24 for t in batched)
    for p, a, b, g in zip(PROMPTS, alone, batched, gaps, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None or g[first] < 0.1, (
            f"{p!r} parted at token {first}, where the top-2 gap is {g[first]:.3f}"
        )
    assert sum(a == b for a, b in zip(alone, batched, strict=True)) >= 3
