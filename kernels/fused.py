"""Fused elementwise kernels of a decoder layer (vLLM's fused_add_rms_norm, rotary embedding with the KV write, and
silu_and_mul), each one launch instead of five to ten.

At decode a layer's GEMMs are a handful of launches, but its norms, rotary embedding, KV writes and activation
were about forty small PyTorch kernels, and at batch 1 on an H100 those took as long as the weights' reads
(bench/results/gpu-*). Each kernel here does the same arithmetic as the PyTorch code it replaces, in the same
order and precision (fp32 inside, rounded to the activation type where PyTorch rounds), so outputs match to the
last bit in the tests up to fp32 contraction. `*_ref` are those PyTorch twins.

Called on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests); wrapped at first call like the other
kernels, using only Triton builtins.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

tl: Any = None  # triton.language, bound on first use


def _rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """One row: h = x (+ residual, rounded as PyTorch adds), out = (h * rsqrt(mean(h^2) + eps) -> dtype) * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    h = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
    if HAS_RES:
        h = h + tl.load(res_ptr + row * D + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * D + cols, h, mask=mask)
    hf = h.to(tl.float32)
    var = tl.reduce(hf * hf, 0, tl.standard._sum_combine) / D
    normed = (hf * (1.0 / tl.sqrt(var + eps))).to(h.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + cols, normed * w, mask=mask)


def _silu_mul(x_ptr, out_ptr, I, BLOCK: tl.constexpr):  # noqa: E741 - the intermediate size
    """out[t, :] = silu(x[t, :I]) * x[t, I:], silu in fp32 then rounded, as F.silu on half tensors."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * 2 * I + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * 2 * I + I + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * I + cols, s * u, mask=mask)


def _rope_cache(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cell_ptr, kc_ptr, vc_ptr,
    stride_qt, stride_kt, stride_vt, stride_ct,
    H, KV, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Token program_id(0): rotate its q heads in place (HF's rotate_half layout, cos/sin [T, 2 HALF] fp32) and
    write its rotated k and its v into cache cell cell_index[t]."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    cos1 = tl.load(cos_ptr + t * 2 * HALF + d)
    cos2 = tl.load(cos_ptr + t * 2 * HALF + HALF + d)
    sin1 = tl.load(sin_ptr + t * 2 * HALF + d)
    sin2 = tl.load(sin_ptr + t * 2 * HALF + HALF + d)
    h = tl.arange(0, BLOCK_H)
    # q: [H, D] at q_ptr + t * stride_qt, heads contiguous
    hm = (h < H)[:, None]
    qp = q_ptr + t * stride_qt + h[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(qp, mask=hm, other=0.0)
    x2 = tl.load(qp + HALF, mask=hm, other=0.0)
    o1 = x1.to(tl.float32) * cos1[None, :] + (-x2).to(tl.float32) * sin1[None, :]
    o2 = x2.to(tl.float32) * cos2[None, :] + x1.to(tl.float32) * sin2[None, :]
    tl.store(qp, o1.to(x1.dtype), mask=hm)
    tl.store(qp + HALF, o2.to(x1.dtype), mask=hm)
    cell = tl.load(cell_ptr + t)
    km = (h < KV)[:, None]
    kp = k_ptr + t * stride_kt + h[:, None] * (2 * HALF) + d[None, :]
    k1 = tl.load(kp, mask=km, other=0.0)
    k2 = tl.load(kp + HALF, mask=km, other=0.0)
    r1 = k1.to(tl.float32) * cos1[None, :] + (-k2).to(tl.float32) * sin1[None, :]
    r2 = k2.to(tl.float32) * cos2[None, :] + k1.to(tl.float32) * sin2[None, :]
    cp = cell * stride_ct + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(kc_ptr + cp, r1.to(k1.dtype), mask=km)
    tl.store(kc_ptr + cp + HALF, r2.to(k1.dtype), mask=km)
    vp = v_ptr + t * stride_vt + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(vc_ptr + cp, tl.load(vp, mask=km, other=0.0), mask=km)
    tl.store(vc_ptr + cp + HALF, tl.load(vp + HALF, mask=km, other=0.0), mask=km)


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any, Any]:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    wrap = InterpretedFunction if interpret else JITFunction
    return wrap(_rms_norm), wrap(_silu_mul), wrap(_rope_cache)


def _interp(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def can_run(device: torch.device) -> bool:
    """CUDA, or the CPU under TRITON_INTERPRET=1."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    interp = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    return device.type == "cuda" or (device.type == "cpu" and interp)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., D] (with `residual`: of x + residual, returned too as the new residual)."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, d).contiguous() if residual is not None else x2
    if x2.shape[0]:
        _kernels(_interp(x))[0][(x2.shape[0],)](
            x2, res, weight, out, res_out, d, eps, HAS_RES=residual is not None, BLOCK=_pow2(d),
            num_warps=4 if d <= 4096 else 8,
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    hf = h.float()
    out = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return out if residual is None else (out, h)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 I] (gate | up) -> silu(gate) * up [..., I]."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter).contiguous()
    out = torch.empty(x2.shape[0], inter, device=x.device, dtype=x.dtype)
    block = min(1024, _pow2(inter))
    if x2.shape[0]:
        _kernels(_interp(x))[1][(x2.shape[0], -(-inter // block))](x2, out, inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cell_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotate q [T, H, D] in place and k [T, KV, D] (cos/sin fp32 [T, D], HF's halves layout), and write k and v
    [T, KV, D] into the caches [cells, KV, D] at cell_index [T]. Returns q. Each tensor's heads and head
    dimension must be contiguous (a split of a fused q|k|v output is)."""
    t, n_heads, dim = q.shape
    n_kv = k.shape[1]
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.stride(-1) != 1 or a.stride(1) != dim:
            raise ValueError(f"rope_and_cache: {name} needs contiguous heads; got strides {a.stride()}")
    if dim & (dim - 1) or dim < 2:
        raise ValueError(f"rope_and_cache needs a power-of-two head size; got {dim}")
    if t:
        _kernels(_interp(q))[2][(t,)](
            q, k, v, cos.contiguous(), sin.contiguous(), cell_index, k_cache, v_cache,
            q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0),
            n_heads, n_kv, HALF=dim // 2, BLOCK_H=_pow2(max(n_heads, n_kv)),
        )  # fmt: skip
    return q


def rope_and_cache_ref(q, k, v, cos, sin, cell_index, k_cache, v_cache) -> torch.Tensor:
    """As rope_and_cache, in PyTorch; cos/sin narrower than the head rotate its first dimensions only (partial
    rotary, Phi-4-mini)."""

    def rot(x):
        r = cos.shape[-1]
        x1, x2 = x[..., :r].chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        out = (x[..., :r].float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    k_cache[cell_index] = rot(k)
    v_cache[cell_index] = v
    return rot(q)
