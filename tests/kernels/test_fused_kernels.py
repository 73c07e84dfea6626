"""The fused decoder-layer kernels against their PyTorch twins (kernels/fused.py), which are the model's own
eager code: RMSNorm with and without the residual add, silu * up, rotary embedding with the KV write; under
Triton's interpreter here, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 - imported before TRITON_INTERPRET is set (see test_w4a16_kernels.py)

from quantserve.kernels import fused

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    on_cuda = request.node.get_closest_marker("cuda") is not None
    if not on_cuda and "bf16" in request.node.name:
        pytest.skip("Triton's interpreter truncates fp32 -> bf16 (GPUs round): bf16 is checked on CUDA only")
    monkeypatch.setenv("TRITON_INTERPRET", "0" if on_cuda else "1")


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same values up to one rounding of the output type (fp32 contraction may move a result by one ulp)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[a.dtype]
    diff = (a.float() - b.float()).abs()
    assert (diff <= ulp * b.float().abs().clamp(min=1)).all(), diff.max()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 576, 4096])
def test_rms_norm(device, dtype, d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(5, d, generator=g) * 3).to(dtype).to(device)
    res = torch.randn(5, d, generator=g).to(dtype).to(device)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype).to(device)
    close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5))
    out, new_res = fused.rms_norm(x, w, 1e-6, res)
    want, want_res = fused.rms_norm_ref(x, w, 1e-6, res)
    close(out, want)
    assert torch.equal(new_res, want_res)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("inter", [96, 1536, 14336])
def test_silu_mul(device, dtype, inter):
    x = (torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype).to(device)
    close(fused.silu_mul(x), fused.silu_mul_ref(x))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("n_heads,n_kv,dim", [(9, 3, 64), (32, 8, 128), (4, 4, 16)])
def test_rope_and_cache(device, dtype, n_heads, n_kv, dim):
    g = torch.Generator().manual_seed(n_heads)
    t = 7
    qkv = torch.randn(t, (n_heads + 2 * n_kv) * dim, generator=g).to(dtype).to(device)
    q, k, v = (a.view(t, -1, dim) for a in qkv.split([n_heads * dim, n_kv * dim, n_kv * dim], dim=-1))
    pos = torch.tensor([0, 5, 17, 3, 100, 2, 64])
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    slots = torch.tensor([40, 3, 17, 8, 31, 0, 22]).to(device)
    kc, vc = (torch.zeros(48, n_kv, dim, dtype=dtype, device=device) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    want = fused.rope_and_cache_ref(q.clone(), k, v, cos, sin, slots, kc2, vc2)
    got = fused.rope_and_cache(q, k, v, cos, sin, slots, kc, vc)
    close(got, want)
    close(kc, kc2)
    assert torch.equal(vc, vc2)
    assert got.data_ptr() == qkv.data_ptr()  # rotated in place, in the fused q|k|v output
