"""Marlin layout (kernels/marlin.py) against references written straight from docs/marlin.md and
docs/quantized-checkpoints.md, "AWQ GEMM layout". Unqualified section names refer to docs/marlin.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantserve.kernels.marlin import (
    MarlinWeight,
    awq_marlin_repack,
    concat_n,
    from_marlin,
    gptq_marlin_repack,
    marlin_permute_bias,
    marlin_permute_scales,
    marlin_repack,
    marlin_unpack,
    marlin_unpack_zero_points,
    marlin_unpermute_scales,
    marlin_zero_points,
    to_marlin,
)
from quantserve.kernels.packing import pack
from quantserve.kernels.qweight import QuantizedWeight, QuantLayoutError

OFF = [0, 1, 8, 9]
SHAPES = [(32, 64), (64, 128), (128, 256)]


def _u32(t: torch.Tensor) -> np.ndarray:
    return t.numpy().astype(np.int64) & 0xFFFFFFFF


def _rand_q(k: int, n: int, bits: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.uint8)


# ---- independent references (plain loops over output words / elements) ----


def _closed_form(q: np.ndarray, bits: int) -> np.ndarray:
    """The "Closed form" (4-bit) and "8-bit words", one output word at a time."""
    k, n = q.shape
    words_per_tile = 1024 * bits // 32  # 128 for 4-bit, 256 for 8-bit
    out = np.zeros((k // 16, n * bits // 2), dtype=np.int64)
    for t in range(k // 16):
        for j in range(out.shape[1]):
            nt, within = divmod(j, words_per_tile)
            if bits == 4:
                lane, w, half = within // 4, within % 4, None
            else:  # index tile_base + lane*8 + warp*2 + {0, 1}
                lane, w, half = within // 8, (within % 8) // 2, within % 2
            r0, c0 = 16 * t + 2 * (lane % 4), 64 * nt + 16 * w + lane // 4
            v = [int(q[r0 + OFF[m], c0]) for m in range(4)] + [int(q[r0 + OFF[m], c0 + 8]) for m in range(4)]
            if bits == 4:
                slots = [v[p] for p in [0, 2, 4, 6, 1, 3, 5, 7]]
            else:
                slots = [v[4 * half + p] for p in [0, 2, 1, 3]]
            out[t, j] = sum(x << (bits * p) for p, x in enumerate(slots))
    return out


def _ist_daslab_perm(interleave: list[int]) -> np.ndarray:
    """Step 2 of "Tiling and the chunk permutation": the 1024-chunk permutation built from 32 lanes, then
    the within-group interleave."""
    perm = []
    for i in range(32):
        lane_idx = []
        col = i // 4
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                lane_idx.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in lane_idx)
    g = len(interleave)
    return np.array(perm).reshape(-1, g)[:, interleave].ravel()


def _ist_daslab_pack(q: np.ndarray, bits: int) -> np.ndarray:
    """All of "Tiling and the chunk permutation": 16x16 tiles flattened row-major, chunk permutation,
    LSB-first pack."""
    k, n = q.shape
    tiles = q.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    interleave = [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3]  # 8-bit: vLLM's get_weight_perm
    res = tiles.reshape(-1, 1024)[:, _ist_daslab_perm(interleave)].reshape(tiles.shape).astype(np.int64)
    pf = 32 // bits
    return sum(res[:, i::pf] << (bits * i) for i in range(pf))


def _scale_perm_formula(single: bool) -> list[int]:
    if single:
        return [2 * a + [0, 1, 8, 9, 16, 17, 24, 25][b] for a in range(4) for b in range(8)]
    return [a + 8 * b for a in range(8) for b in range(8)]


def _permute_chunks(flat: list, perm: list[int]) -> list:
    c = len(perm)
    return [flat[base + perm[t]] for base in range(0, len(flat), c) for t in range(c)]


# ---- weight layout ----


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_perm", [False, True])
def test_repack_matches_closed_form(bits: int, shape: tuple[int, int], with_perm: bool) -> None:
    q = _rand_q(*shape, bits, seed=shape[0] + bits)
    perm = torch.randperm(shape[0], generator=torch.Generator().manual_seed(1)).int() if with_perm else None
    rows = q[perm.long()] if with_perm else q
    got = marlin_repack(q, bits, perm)
    assert got.dtype == torch.int32 and tuple(got.shape) == (shape[0] // 16, shape[1] * bits // 2)
    assert np.array_equal(_u32(got), _closed_form(rows.numpy(), bits))
    assert torch.equal(marlin_unpack(got, *shape, bits), rows)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_ist_daslab_packer_equals_closed_form(bits: int, shape: tuple[int, int]) -> None:
    q = _rand_q(*shape, bits, seed=7).numpy()
    ref = _ist_daslab_pack(q, bits)
    assert np.array_equal(ref, _closed_form(q, bits))  # the docs' claim
    assert np.array_equal(_u32(marlin_repack(torch.from_numpy(q), bits)), ref)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("empty", [False, True])
def test_gptq_marlin_repack(bits: int, empty: bool) -> None:
    k, n = 128, 192
    q = _rand_q(k, n, bits, seed=3)
    # GPTQ qweight [K/pf, N], natural order (docs/quantized-checkpoints.md, "GPTQ bit packing")
    b_q_weight = pack(q, bits, dim=0)
    if empty:
        perm = torch.empty(0, dtype=torch.int32)
        assert torch.equal(gptq_marlin_repack(b_q_weight, perm, k, n, bits), marlin_repack(q, bits))
        assert torch.equal(gptq_marlin_repack(b_q_weight, None, k, n, bits), marlin_repack(q, bits))
    else:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(5)).int()
        got = gptq_marlin_repack(b_q_weight, perm, k, n, bits)
        assert torch.equal(got, marlin_repack(q[perm.long()], bits))
        assert np.array_equal(_u32(got), _closed_form(q[perm.long()].numpy(), bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_awq_marlin_repack(bits: int) -> None:
    k, n = 64, 128
    pf = 32 // bits
    # "AWQ GEMM layout": logical column pf*c + j lives in slot inv[j]; 8-bit uses vLLM's undo_pack
    # [0, 2, 1, 3]
    inv = [0, 4, 1, 5, 2, 6, 3, 7] if bits == 4 else [0, 2, 1, 3]
    q = _rand_q(k, n, bits, seed=11).numpy().astype(np.int64)
    words = np.zeros((k, n // pf), dtype=np.int64)
    for c in range(n // pf):
        for j in range(pf):
            words[:, c] |= q[:, pf * c + j] << (bits * inv[j])
    b_q_weight = torch.from_numpy(np.where(words >= 1 << 31, words - (1 << 32), words).astype(np.int32))
    got = awq_marlin_repack(b_q_weight, k, n, bits)
    assert torch.equal(got, marlin_repack(torch.from_numpy(q.astype(np.uint8)), bits))


# ---- scales, zero points, bias ----


@pytest.mark.parametrize(
    ("n_groups", "size_k", "group_size", "single"),
    [(4, 512, 128, False), (2, 128, 64, False), (1, 256, -1, True), (1, 128, 128, True), (8, 256, 32, False)],
)
def test_scale_permutation(n_groups: int, size_k: int, group_size: int, single: bool) -> None:
    n = 192
    s = torch.randn(n_groups, n, dtype=torch.float16)
    want = _permute_chunks(s.flatten().tolist(), _scale_perm_formula(single))
    got = marlin_permute_scales(s, size_k, n, group_size)
    assert got.flatten().tolist() == want
    assert torch.equal(marlin_unpermute_scales(got, size_k, n, group_size), s)


def test_bias_permutation() -> None:
    bias = torch.randn(128)
    want = _permute_chunks(bias.tolist(), _scale_perm_formula(single=True))
    assert marlin_permute_bias(bias).tolist() == want


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_points(bits: int) -> None:
    n_groups, n = 3, 128
    zp = _rand_q(n_groups, n, bits, seed=13)
    # "Zero points" steps: scale_perm on chunks of 64, interleave inside every pf, pack LSB-first along N
    flat = _permute_chunks(zp.flatten().tolist(), _scale_perm_formula(single=False))
    flat = _permute_chunks(flat, [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3])
    pf = 32 // bits
    want = np.array(
        [sum(flat[i + p] << (bits * p) for p in range(pf)) for i in range(0, len(flat), pf)], dtype=np.int64
    ).reshape(n_groups, n // pf)
    got = marlin_zero_points(zp, 256, n, bits)
    assert got.dtype == torch.int32 and np.array_equal(_u32(got), want)
    assert torch.equal(marlin_unpack_zero_points(got, 256, n, bits), zp)


# ---- QuantizedWeight round trip ----


def _rand_weight(
    bits: int, sym: bool, group_size: int, act_order: bool, k: int = 256, n: int = 128
) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(bits * 1000 + group_size + 7 * act_order + 3 * sym)
    group = k if group_size == -1 else group_size
    n_groups = k // group
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    return QuantizedWeight(
        qweight=torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.uint8),
        scales=torch.rand(n_groups, n, generator=gen).to(torch.float16) + 0.01,
        zeros=None if sym else torch.randint(0, 1 << bits, (n_groups, n), generator=gen, dtype=torch.uint8),
        bits=bits,
        group_size=group_size,
        g_idx=g_idx,
    )


CASES = [
    (bits, sym, gs, act)
    for bits in (4, 8)
    for sym in (True, False)
    for gs in (-1, 64, 128)
    for act in (False, True)
    if sym or bits == 4
]


@pytest.mark.parametrize(("bits", "sym", "group_size", "act_order"), CASES)
def test_round_trip(bits: int, sym: bool, group_size: int, act_order: bool) -> None:
    w = _rand_weight(bits, sym, group_size, act_order)
    m = to_marlin(w)
    assert isinstance(m, MarlinWeight) and (m.K, m.N, m.bits, m.group_size) == (256, 128, bits, group_size)
    assert tuple(m.qweight.shape) == (16, 128 * bits // 2) and m.qweight.dtype == torch.int32
    assert (m.zeros is None) == sym and (m.perm is None) == (not act_order)
    if act_order:
        assert m.perm.dtype == torch.int32 and m.g_idx.dtype == torch.int32
        assert torch.equal(m.perm.long(), torch.argsort(w.g_idx, stable=True))
        assert bool((m.g_idx[1:] >= m.g_idx[:-1]).all())
    back = from_marlin(m)
    assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    assert back.scales.dtype == w.scales.dtype
    assert (back.zeros is None and w.zeros is None) or torch.equal(back.zeros, w.zeros)
    assert (back.g_idx is None and w.g_idx is None) or torch.equal(back.g_idx, w.g_idx)
    assert (back.bits, back.group_size) == (w.bits, w.group_size)
    ref = w.dequantize()
    assert torch.equal(back.dequantize(), ref)
    # The kernel's view: packed row k is input column perm[k], with group sorted_g_idx[k].
    rows = marlin_unpack(m.qweight, m.K, m.N, bits).float()
    scales = marlin_unpermute_scales(m.scales, m.K, m.N, group_size).float()
    zeros = (
        torch.full_like(scales, 1 << (bits - 1))
        if m.zeros is None
        else marlin_unpack_zero_points(m.zeros, m.K, m.N, bits).float()
    )
    g = m.g_idx.long() if act_order else torch.arange(m.K) // (m.K if group_size == -1 else group_size)
    perm = m.perm.long() if act_order else torch.arange(m.K)
    assert torch.equal(scales[g] * (rows - zeros[g]), ref[perm])


@pytest.mark.parametrize(("bits", "sym", "group_size", "act_order"), CASES)
def test_concat_n_commutes_with_the_repack(bits: int, sym: bool, group_size: int, act_order: bool) -> None:
    """Fusing (q | k | v) after the repack gives the repack of the fused weight, bit for bit."""
    parts = [_rand_weight(bits, sym, group_size, act_order, n=n) for n in (128, 64, 192)]
    base = parts[0]  # one act-order permutation for all: the fused linears share their input
    parts = [QuantizedWeight(p.qweight, p.scales, p.zeros, bits, group_size, base.g_idx) for p in parts]
    fused = QuantizedWeight(
        torch.cat([p.qweight for p in parts], 1),
        torch.cat([p.scales for p in parts], 1),
        None if sym else torch.cat([p.zeros for p in parts], 1),
        bits,
        group_size,
        base.g_idx,
    )
    want = to_marlin(fused)
    got = concat_n([to_marlin(p) for p in parts])
    assert (got.K, got.N) == (want.K, want.N) == (256, 384)
    for name in ("qweight", "scales", "zeros", "g_idx", "perm"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def test_concat_n_refuses_different_permutations() -> None:
    a, b = _rand_weight(4, True, 64, True), _rand_weight(4, True, 64, True, n=64)
    b = QuantizedWeight(b.qweight, b.scales, None, 4, 64, torch.flip(a.g_idx, [0]))
    with pytest.raises(QuantLayoutError, match="act-order"):
        concat_n([to_marlin(a), to_marlin(b)])


def test_round_trip_uneven_g_idx_and_bf16() -> None:
    gen = torch.Generator().manual_seed(99)
    w = _rand_weight(4, False, 32, False, k=128, n=64)
    w = QuantizedWeight(
        w.qweight,
        w.scales.to(torch.bfloat16),
        w.zeros,
        4,
        32,
        torch.randint(0, 4, (128,), generator=gen).int(),
    )
    back = from_marlin(to_marlin(w))
    assert torch.equal(back.g_idx, w.g_idx) and torch.equal(back.qweight, w.qweight)
    assert torch.equal(back.scales, w.scales) and torch.equal(back.dequantize(), w.dequantize())


# ---- errors ----


def test_errors_name_the_numbers() -> None:
    ok = _rand_weight(4, True, -1, False, k=64, n=64)
    with pytest.raises(QuantLayoutError, match=r"K=40"):
        to_marlin(QuantizedWeight(ok.qweight[:40], ok.scales, None, 4, -1))
    with pytest.raises(QuantLayoutError, match=r"N=96"):
        to_marlin(_rand_weight(4, True, -1, False, k=64, n=96))
    with pytest.raises(QuantLayoutError, match=r"3-bit"):
        to_marlin(QuantizedWeight(ok.qweight & 7, ok.scales, None, 3, -1))
    with pytest.raises(QuantLayoutError, match=r"asymmetric 8-bit"):
        to_marlin(_rand_weight(8, False, 64, False, k=64, n=64))
    with pytest.raises(QuantLayoutError, match=r"K=40, N=64"):
        marlin_repack(ok.qweight[:40], 4)
    with pytest.raises(QuantLayoutError, match=r"\[8, 64\]"):
        gptq_marlin_repack(torch.zeros(4, 64, dtype=torch.int32), None, 64, 64, 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    w = _rand_weight(4, False, 128, True)
    m_cpu = to_marlin(w)
    wc = QuantizedWeight(w.qweight.cuda(), w.scales.cuda(), w.zeros.cuda(), 4, 128, w.g_idx.cuda())
    m_gpu = to_marlin(wc)
    assert torch.equal(m_gpu.qweight.cpu(), m_cpu.qweight) and torch.equal(m_gpu.zeros.cpu(), m_cpu.zeros)
    assert torch.equal(from_marlin(m_gpu).qweight.cpu(), w.qweight)
