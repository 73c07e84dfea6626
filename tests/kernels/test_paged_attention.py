"""The paged decode-attention kernel against gather-then-SDPA in fp32: grouped heads, padded head sizes, contexts
that end inside, at and just past a block, blocks in any order; under Triton's interpreter here, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 - imported before TRITON_INTERPRET is set (see test_w4a16_kernels.py)

from quantserve.kernels.paged_attention import paged_decode_attention


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.node.get_closest_marker("cuda") else "1")


def reference(q, k_cache, v_cache, tables, lens, block_size, scale, window=0, softcap=0.0, sinks=None):
    """fp64: gather each sequence's last `window` (all) positions, cap the scaled scores, softmax (with each head's
    sink logit as one more column, then dropped), weight V."""
    out = []
    for b in range(q.shape[0]):
        pos = torch.arange(max(0, int(lens[b]) - window) if window else 0, int(lens[b]))
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        rep = q.shape[1] // k_cache.shape[1]
        k = k_cache[slots].double().repeat_interleave(rep, 1)  # [C, H, D]
        v = v_cache[slots].double().repeat_interleave(rep, 1)
        s = torch.einsum("hd,chd->hc", q[b].double(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        p = (
            s.softmax(-1)
            if sinks is None
            else torch.cat((s, sinks.double()[:, None]), -1).softmax(-1)[:, :-1]
        )
        out.append(torch.einsum("hc,chd->hd", p, v))
    return torch.stack(out)


def case(device, dtype, n_heads, n_kv, dim, lens, block_size=16, seed=0, window=0, softcap=0.0, sinks=None):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens) + 1
    n_blocks = len(lens) * width + 3
    slots = n_blocks * block_size
    k_cache = torch.randn(slots, n_kv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, n_kv, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), n_heads, dim, generator=gen).to(dtype)
    tables = (
        torch.randperm(n_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    )
    lens_t = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, lens_t, block_size, dim**-0.5)
    ref = reference(*args, window=window, softcap=softcap, sinks=sinks)
    out = paged_decode_attention(
        *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), window=window, softcap=softcap,
        sinks=None if sinks is None else sinks.to(device),
    )  # fmt: skip
    return out.cpu(), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n_heads,n_kv,dim,lens",
    [
        (8, 2, 64, [1, 15, 16, 17, 100]),  # GQA 4: one block, the end of a block, just past it, many blocks
        (4, 4, 80, [33, 7]),  # no grouping; head size 80 padded to 128
        (14, 2, 64, [130]),  # group of 7 (SmolLM2-like 9/3 too: any G), contexts past two BLOCK_N
        (9, 3, 64, [65, 3]),
    ],
)
def test_matches_gather_then_sdpa(dtype, n_heads, n_kv, dim, lens):
    out, ref = case("cpu", dtype, n_heads, n_kv, dim, lens)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1, 16, 17, 300, 4097], [128] * 64])
@pytest.mark.parametrize(
    "n_heads,n_kv,dim,window,softcap",
    [(32, 8, 128, 0, 0.0), (9, 3, 64, 0, 0.0), (16, 8, 256, 1024, 0.0), (8, 4, 256, 100, 50.0)],
    ids=["llama", "g3", "gemma3-window", "gemma2-window-cap"],
)
def test_cuda_matches_gather_then_sdpa(dtype, lens, n_heads, n_kv, dim, window, softcap):
    out, ref = case("cuda", dtype, n_heads, n_kv, dim, lens, window=window, softcap=softcap)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(6, 0.0), (50, 0.0), (0, 5.0), (20, 2.0)])
def test_windows_and_soft_caps_match_the_reference(dtype, window, softcap):
    """Gemma's windowed layers read only their last `window` positions (contexts shorter than the window, at it,
    and many blocks past it), and Gemma 2's cap bounds the scores (caps small enough to bite)."""
    out, ref = case("cpu", dtype, 8, 2, 64, [1, 6, 7, 100, 300], window=window, softcap=softcap)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()
    if window:
        plain, _ = case("cpu", dtype, 8, 2, 64, [1, 6, 7, 100, 300], softcap=softcap)
        assert not torch.allclose(plain[3:].double(), ref[3:], atol=tol, rtol=tol)  # the window mattered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 6])
def test_sinks_match_the_reference(dtype, window):
    """gpt-oss's sinks: one more logit per head in the softmax's sum (some larger than every score, some far
    below), with and without its 128-token window (6 here)."""
    sinks = torch.tensor([4.0, -3.0, 0.5, 9.0, -20.0, 1.0, 2.0, 0.0])
    out, ref = case("cpu", dtype, 8, 2, 64, [1, 6, 7, 100], window=window, sinks=sinks)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()
    plain, _ = case("cpu", dtype, 8, 2, 64, [1, 6, 7, 100], window=window)
    assert not torch.allclose(plain.double(), ref, atol=tol, rtol=tol)  # the sinks mattered


def test_errors_name_the_shapes():
    q = torch.zeros(1, 6, 64)
    cache = torch.zeros(16, 4, 64)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 KV heads"):
        paged_decode_attention(
            q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16, 0.125
        )
