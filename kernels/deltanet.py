"""One decoding step of the gated delta rule (Qwen3.5's Gated DeltaNet, backends/torch/deltanet.py) for a batch of
sequences, each continuing the state in its own slot, updated in place: one Triton program per (sequence, value
head, block of value columns).

For a sequence in slot s and value head h (key head h // (H_v / H_k), as transformers repeats the key heads), with
S = state[s, h] [d_k, d_v] in fp32:

    S <- exp(g) S;    S <- S + k (beta (v - S^T k))^T;    o = S^T q

Each value column j of S is updated from column j alone (S^T k, the delta and S^T q are taken column by column),
so the columns split across programs with no exchange between them. q and k arrive normalised (q scaled by
1/sqrt(d_k)), g and beta computed, all fp32, as the exact PyTorch rule takes them; the PyTorch rule
(`delta_rule_recurrent`) is the reference, and this kernel is the CUDA path for decoding, where a step is a small
read-modify-write of each state that PyTorch would run as a dozen kernels with a gather and a scatter around them.
Prefill keeps the chunked PyTorch form: it is batched matmuls, which the GPU runs well already.

Like paged_attention.py, the kernel calls only Triton builtins (tl.reduce with triton's own combine function, which
the interpreter maps to numpy; not tl.sum, a jitted helper) and is wrapped at first call, keyed by the interpreter, so
that the CPU tests run it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

tl: Any = None  # triton.language, bound on first use: importing this module never imports triton


def _decode_step(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, o_ptr,
    GROUP, DK, DV,
    stride_qb, stride_qh, stride_vb, stride_vh, stride_gb, stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Sequence program_id(0), value head program_id(1), value columns program_id(2) * BV onwards."""
    b = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_mask = kk < DK
    v_mask = vv < DV
    q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + kk, mask=k_mask, other=0.0)
    k = tl.load(k_ptr + b * stride_qb + hk * stride_qh + kk, mask=k_mask, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + hv * stride_vh + vv, mask=v_mask, other=0.0)
    g = tl.load(g_ptr + b * stride_gb + hv)
    beta = tl.load(beta_ptr + b * stride_gb + hv)
    slot = tl.load(slot_ptr + b)  # int64: the state's offset cannot overflow
    where = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(where, mask=mask, other=0.0) * tl.exp(g)
    delta = (v - tl.reduce(s * k[:, None], 0, tl.standard._sum_combine)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(where, s, mask=mask)
    o = tl.reduce(s * q[:, None], 0, tl.standard._sum_combine)
    tl.store(o_ptr + b * stride_ob + hv * stride_oh + vv, o, mask=v_mask)


@functools.cache
def _kernel(interpret: bool) -> Any:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    return (InterpretedFunction if interpret else JITFunction)(_decode_step)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q, k [B, H_k, d_k] (normalised), v [B, H_v, d_v], g and beta [B, H_v], all fp32; state [S, H_v, d_k, d_v]
    fp32, updated in place at rows `slots` [B] (distinct) -> o [B, H_v, d_v] fp32."""
    bsz, n_v, d_v = v.shape
    n_k, d_k = q.shape[1], q.shape[2]
    if state.dtype != torch.float32 or q.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("decode_step takes fp32 inputs and a contiguous fp32 state")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty_like(v)
    if bsz == 0:
        return out
    bk = max(16, 1 << (d_k - 1).bit_length())
    bv = min(32, max(16, 1 << (d_v - 1).bit_length()))
    grid = (bsz, n_v, (d_v + bv - 1) // bv)
    _kernel(q.device.type == "cpu")[grid](
        q, k, v, g, beta, state, slots, out, n_v // n_k, d_k, d_v,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        BK=bk, BV=bv, num_warps=4,
    )  # fmt: skip
    return out
