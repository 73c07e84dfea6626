"""The 2026 families' CUDA paths, for a lent GPU (bench/gpu/run.sh runs these with the other `cuda` tests): the MXFP4
GEMM and the paged decode kernel with sinks compiled for the device against their references, and the tiny gpt-oss
(MXFP4 experts) and Qwen3.5 models in bf16 on the GPU, each step of the engine's paged path against the
whole-sequence forward and against fp32 on the CPU. Skipped without CUDA; `check_*` take the device, so that the
same checks can be run on the CPU by hand."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 - before TRITON_INTERPRET is touched (see tests/kernels/test_w4a16_kernels.py)

from quantserve.kernels import mxfp4
from tests.backends.torch.test_torch_gpt_oss import make_checkpoints as gpt_oss_checkpoints
from tests.backends.torch.test_torch_moe import LONG
from tests.backends.torch.test_torch_qwen35 import _build as qwen35_checkpoint
from tests.backends.torch.test_torch_qwen35 import rule_inputs
from tests.kernels.test_paged_attention import case

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU = torch.device("cuda")


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def check_mxfp4_gemm(device: torch.device, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    blocks, scales = mxfp4.quantize(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    want = mxfp4.mxfp4_linear_ref(x.double(), blocks, scales, bias.double())
    got = mxfp4.mxfp4_linear(x.to(device), blocks.to(device), scales.to(device), bias.to(device)).cpu()
    # bf16 / fp16 products of exact weights, fp32 accumulation, one rounding of the output
    rel = ((got.double() - want).abs() / (want.abs() * 2.0**-7 + want.abs().max() * 1e-3)).max()
    assert got.dtype == dtype and rel < 1, rel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 2880, 2880), (16, 5760, 2880), (300, 96, 160)])
def test_mxfp4_gemm_equals_dequantize_then_matmul(dtype, m, n, k):
    check_mxfp4_gemm(GPU, dtype, m, n, k)


@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_grouped_mxfp4_experts_at_gpt_oss_sizes(tokens):
    """kernels/mxfp4.py's grouped GEMM compiled for the GPU, at gpt-oss-20b's gate_up (N 5760, K 2880) with 8
    experts, top 4, in bf16 (16, 32 and 64 rows a block): each slot's row against its expert's dequantized weight
    and bias in fp32, from the tokens, and from a row per slot times its routed weight (the down projection's
    form)."""
    from quantserve.kernels.w4a16_moe import align_by_expert, choose_block_m

    gen = torch.Generator(device=GPU).manual_seed(tokens)
    n_exp, top_k, n, k = 8, 4, 5760, 2880
    parts = [mxfp4.quantize(torch.randn(n, k, generator=gen, device=GPU)) for _ in range(n_exp)]
    blocks, scales = torch.stack([b for b, _ in parts]), torch.stack([s for _, s in parts])
    bias = torch.randn(n_exp, n, generator=gen, device=GPU).bfloat16()
    x = torch.randn(tokens, k, generator=gen, device=GPU).bfloat16()
    chosen = torch.stack([torch.randperm(n_exp, generator=gen, device=GPU)[:top_k] for _ in range(tokens)])
    routed = torch.rand(tokens * top_k, generator=gen, device=GPU)
    block_m = max(16, choose_block_m(tokens * top_k, n_exp))
    aligned = align_by_expert(chosen, n_exp, block_m)
    experts = chosen.flatten()
    slot_x = x.float().repeat_interleave(top_k, 0)
    want = torch.empty(tokens * top_k, n, device=GPU)
    for e in range(n_exp):  # (one expert's fp32 weight at a time: 66 MB)
        mine = experts == e
        want[mine] = slot_x[mine] @ mxfp4.dequantize(blocks[e], scales[e]).T + bias[e].float()
    by_tokens = mxfp4.mxfp4_moe_gemm(x, blocks, scales, bias, aligned, block_m, top_k, tokens * top_k)
    by_slots = mxfp4.mxfp4_moe_gemm(slot_x.bfloat16(), blocks, scales, bias, aligned, block_m, 0, tokens * top_k,
                                    routed)  # fmt: skip
    for got, ref in ((by_tokens, want), (by_slots, want * routed[:, None])):
        rel = ((got.float() - ref).abs() / (ref.abs() * 2.0**-7 + ref.abs().max() * 1e-3)).max()
        assert rel < 1, (block_m, rel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 128])
def test_paged_decode_with_sinks(dtype, window):
    sinks = torch.linspace(-4, 4, 64)
    out, ref = case("cuda", dtype, 64, 8, 64, [1, 127, 128, 129, 2000], window=window, sinks=sinks)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()


@pytest.mark.parametrize("batch", [1, 8])
def test_deltanet_decode_kernel_at_qwen35_sizes(batch):
    """kernels/deltanet.py compiled for the GPU against the recurrent rule in fp32: Qwen3.5's 16 key heads, 32
    value heads of 128 x 128, slots out of order."""
    from quantserve.backends.torch.deltanet import delta_rule_recurrent
    from quantserve.kernels.deltanet import decode_step

    gen = torch.Generator().manual_seed(batch)
    n_k, n_v, d = 16, 32, 128
    q, k, v, g, beta = rule_inputs(batch, n_k, n_v, d, d, gen, decay=2.0)
    state = torch.randn(batch + 2, n_v, d, d, generator=gen)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    want, new = delta_rule_recurrent(q[:, None].repeat_interleave(2, 2), k[:, None].repeat_interleave(2, 2),
                                     v[:, None], g[:, None], beta[:, None], state[slots])  # fmt: skip
    on = state.to(GPU)
    got = decode_step(q.to(GPU), k.to(GPU), v.to(GPU), g.to(GPU), beta.to(GPU), on, slots.to(GPU)).cpu()
    assert (got - want[:, 0]).abs().max() < 1e-4 * want.abs().max()
    assert (on[slots.to(GPU)].cpu() - new).abs().max() < 1e-4 * new.abs().max()


@pytest.mark.parametrize("t", [5, 300])
def test_deltanet_prefill_kernel_at_qwen35_sizes(t):
    """kernels/deltanet.py's chunked prefill compiled for the GPU against the chunked rule in fp32 (Qwen3.5's heads,
    a state carried in), the slot's state updated in place."""
    from quantserve.backends.torch.deltanet import delta_rule_chunked
    from quantserve.kernels.deltanet import prefill

    gen = torch.Generator().manual_seed(t)
    n_k, n_v, d = 16, 32, 128
    q, k, v, g, beta = rule_inputs(t, n_k, n_v, d, d, gen, decay=1.0)
    state = 0.1 * torch.randn(3, n_v, d, d, generator=gen)
    want, new = delta_rule_chunked(q[None].repeat_interleave(2, 2), k[None].repeat_interleave(2, 2), v[None],
                                   g[None], beta[None], state[2:3])  # fmt: skip
    on = state.to(GPU)
    got = prefill(q.to(GPU), k.to(GPU), v.to(GPU), g.to(GPU), beta.to(GPU), on, 2).cpu()
    assert (got - want[0]).abs().max() < 1e-4 * want.abs().max()
    assert (on[2].cpu() - new[0]).abs().max() < 1e-4 * new.abs().max()


def check_model(src, device: torch.device) -> None:
    """bf16 on `device`: the prompt's logits against the same model in bf16 on the CPU (the same arithmetic, other
    kernels) and, loosely, in fp32 (a random model in bf16 drifts by a few percent); then the engine's paged path,
    batched and chunked, to the end without a leak."""
    from quantserve.backends.torch.tokenizer import HFTokenizer
    from quantserve.backends.torch.weights import load_model
    from quantserve.formats import detect
    from tests.backends.torch.test_torch_engine import make_engine
    from tests.backends.torch.test_torch_moe import PROMPTS, _together

    spec = detect(src)
    ids = torch.tensor([LONG])
    with torch.no_grad():
        ref32, ref16 = (
            load_model(spec, dtype=dt, device=torch.device("cpu")) for dt in (torch.float32, torch.bfloat16)
        )
        fp32, cpu16 = ref32.compute_logits(ref32(ids)), ref16.compute_logits(ref16(ids))
        model = load_model(spec, dtype=torch.bfloat16, device=device)
        got = model.compute_logits(model(ids.to(device))).cpu()
    assert (got - cpu16).abs().mean() < 2e-2 * cpu16.abs().mean()
    assert (got - fp32).abs().mean() < 1e-1 * fp32.abs().mean()
    engine, _ = make_engine((model, HFTokenizer.from_dir(src)), max_num_seqs=4, kv_tokens=1024, n_batch=16,
                            device=device)  # fmt: skip
    assert all(len(t) == 8 for t in _together(engine, PROMPTS, 8))
    assert engine.kv.num_used == 0


def test_gpt_oss_mxfp4_in_bf16(smollm2_gguf, tmp_path_factory):
    check_model(gpt_oss_checkpoints(smollm2_gguf, tmp_path_factory)["mxfp4"], GPU)


def test_qwen35_in_bf16(smollm2_gguf, tmp_path_factory):
    check_model(qwen35_checkpoint("dense", smollm2_gguf, tmp_path_factory), GPU)
