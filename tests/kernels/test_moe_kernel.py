"""The grouped W4A16 MoE kernel (kernels/w4a16_moe.py) against an fp32 loop over tokens and experts on the
dequantized weights, under Triton's interpreter here and compiled on a GPU (marked `cuda`), and the expert sort
that feeds it. See tests/kernels/test_w4a16_kernels.py for why TRITON_INTERPRET is set per test."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 - imported before any test sets TRITON_INTERPRET

from quantserve.kernels.marlin import to_marlin
from quantserve.kernels.qweight import QuantizedWeight
from quantserve.kernels.reference import relative_error
from quantserve.kernels.w4a16_moe import (
    align_by_expert,
    choose_block_m,
    fused_moe,
    fused_moe_reference,
    stack_experts,
)
from quantserve.kernels.w4a16_plain import prepare_plain

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.node.get_closest_marker("cuda") else "1")


def quantized(k, n, group, bits, zp, gen) -> QuantizedWeight:
    rows = k if group == -1 else group
    n_groups = -(-k // rows)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n_groups, n, generator=gen) * 0.02 + 0.002).to(F16)
    zeros = torch.randint(0, 1 << bits, (n_groups, n), generator=gen, dtype=torch.uint8) if zp else None
    return QuantizedWeight(q, scales, zeros, bits, group)


def experts(n_experts, hidden, inter, group, bits, zp, device, seed=0):
    """(gate_up MoeState, down MoeState, dense gate_up [E, H, 2I], dense down [E, I, H]) of random experts."""
    gen = torch.Generator().manual_seed(seed)
    states, dense_gu, dense_down = [], [], []
    for _ in range(n_experts):
        gate, up = (
            quantized(hidden, inter, group, bits, zp, gen),
            quantized(hidden, inter, group, bits, zp, gen),
        )
        down = quantized(inter, hidden, group, bits, zp, gen)
        plain = [prepare_plain(to_marlin(w)) for w in (gate, up, down)]
        states.append(plain)
        dense_gu.append(torch.cat([gate.dequantize(), up.dequantize()], dim=1))
        dense_down.append(down.dequantize())
    moved = [[_to(s, device) for s in parts] for parts in states]
    gate_up = stack_experts([parts[:2] for parts in moved])
    down = stack_experts([parts[2:] for parts in moved])
    return gate_up, down, torch.stack(dense_gu), torch.stack(dense_down)


def _to(state, device):
    import dataclasses

    return dataclasses.replace(
        state,
        qweight=state.qweight.to(device),
        scales=state.scales.to(device),
        zeros=None if state.zeros is None else state.zeros.to(device),
    )


def routing(tokens, n_experts, top_k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


# (tokens, experts, top-k, hidden, intermediate, group, bits, zero points, x dtype): block_m 1 (tokens * k <=
# experts), 16 and 32, per-channel and grouped scales, 8-bit, an expert that no token chose
CASES = [
    (1, 8, 2, 128, 64, 64, 4, False, F16),
    (3, 8, 2, 256, 128, 128, 4, True, BF16),
    (20, 4, 2, 128, 64, 32, 4, False, F32),
    (40, 4, 2, 128, 128, -1, 4, True, F16),
    (9, 8, 1, 128, 64, 64, 8, False, F16),
    (70, 4, 2, 64, 64, 32, 4, False, BF16),
    (100, 4, 2, 64, 64, 64, 4, True, F16),  # 50 slots per expert: 64-row tiles (half K blocks)
]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("tokens,n_experts,top_k,hidden,inter,group,bits,zp,dtype", CASES)
def test_fused_moe_matches_reference(device, tokens, n_experts, top_k, hidden, inter, group, bits, zp, dtype):
    gate_up, down, dense_gu, dense_down = experts(n_experts, hidden, inter, group, bits, zp, device)
    ids, weights = routing(tokens, n_experts, top_k)
    if tokens == 9:
        ids[ids == 3] = 4  # expert 3 gets no token: its blocks must not exist
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = fused_moe(
        x.to(device), gate_up, down, ids.to(device), weights.to(device), interpret=device == "cpu"
    )
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    ref = fused_moe_reference(x, dense_gu, dense_down, ids, weights).to(dtype)
    # the intermediate is rounded to x's dtype between the GEMMs (as the per-expert path does): bf16's 8 bits
    # of mantissa put a few 1e-3 on the result
    assert relative_error(out.cpu(), ref) < (1e-2 if dtype == BF16 else 2e-3)


@pytest.mark.parametrize("block_m", [1, 16])
def test_align_by_expert_sorts_and_pads_every_slot_once(block_m):
    ids, _ = routing(13, 6, 2, seed=5)
    ids[ids == 2] = 1  # an empty expert
    sorted_slots, block_expert, n_padded = align_by_expert(ids, 6, block_m)
    s, n = ids.numel(), int(n_padded)
    flat = ids.reshape(-1)
    real = sorted_slots[:n]
    assert sorted(real[real < s].tolist()) == list(range(s))  # every slot once
    assert bool((sorted_slots[n:] == s).all())  # nothing after the padded total
    for b in range(n // block_m):
        block = real[b * block_m : (b + 1) * block_m]
        used = block[block < s].long()
        assert used.numel() > 0  # no block is padding only
        assert bool((flat[used] == int(block_expert[b])).all())
    assert n == sum(-(-int((flat == e).sum()) // block_m) * block_m for e in range(6))


def test_block_m_follows_the_slots_per_expert():
    assert [choose_block_m(s, 128) for s in (8, 128, 129, 2048, 4096, 8192)] == [1, 1, 16, 16, 32, 64]


def test_experts_that_cannot_share_a_launch_are_not_stacked():
    gen = torch.Generator().manual_seed(0)
    a = prepare_plain(to_marlin(quantized(128, 64, 64, 4, False, gen)))
    b = prepare_plain(to_marlin(quantized(128, 64, 32, 4, False, gen)))  # another group size
    c = prepare_plain(to_marlin(quantized(128, 64, 64, 4, True, gen)))  # zero points
    assert stack_experts([[a], [a]]) is not None
    assert stack_experts([[a], [b]]) is None
    assert stack_experts([[a], [c]]) is None
