"""The gated delta rule (Qwen3.5's Gated DeltaNet, backends/torch/deltanet.py) as Triton kernels, each continuing
states kept in slots and updating them in place: `decode_step`, one token for each of a batch of sequences, one
program per (sequence, value head, block of value columns); and `prefill`, one sequence's tokens in the chunked
form, one program per (value head, block of value columns).

For a sequence in slot s and value head h (key head h // (H_v / H_k), as transformers repeats the key heads), with
S = state[s, h] [d_k, d_v] in fp32:

    S <- exp(g) S;    S <- S + k (beta (v - S^T k))^T;    o = S^T q

Each value column j of S is updated from column j alone (S^T k, the delta and S^T q are taken column by column),
so the columns split across programs with no exchange between them. q and k arrive normalised (q scaled by
1/sqrt(d_k)), g and beta computed, all fp32, as the exact PyTorch rule takes them; the PyTorch rule
(`delta_rule_recurrent`) is the reference, and `decode_step` is the CUDA path for decoding, where a step is a small
read-modify-write of each state that PyTorch would run as a dozen kernels with a gather and a scatter around them.

`prefill` takes PREFILL_CHUNK tokens at a time, in the WY form that backends/torch/deltanet.py's docstring writes
out: within a chunk A = beta_t exp(G_t - G_i) k_t . k_i (i < t), the inverse of I + A by forward substitution
(row i is e_i minus A's row i times the rows above it, which are final), then U, the chunk's outputs and the new
state with a few tl.dot each, in fp32 ("ieee": no TF32). The tokens past the end of the last chunk load as zeros
(q = k = v = 0, beta = 0), which change nothing, and the exponentials that could overflow there are discarded by
tl.where before any product.

Like paged_attention.py, the kernels call only Triton builtins (tl.reduce with triton's own combine function, which
the interpreter maps to numpy; not tl.sum, a jitted helper) and are wrapped at first call, keyed by the interpreter,
so that the CPU tests run them under TRITON_INTERPRET=1.
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


def _prefill(
    q_ptr, k_ptr, v_ptr, gc_ptr, beta_ptr, state_ptr, o_ptr, slot, T, GROUP, DK, DV,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One sequence's T tokens, BT at a time, for value head program_id(0) and value columns program_id(1) * BV
    onwards, from the state in `slot` (updated in place). gc: g's running sum within each chunk of BT."""
    hv = tl.program_id(0)
    hk = hv // GROUP
    tt = tl.arange(0, BT).to(tl.int64)  # (offsets of T x heads x d past 2^31 in long prompts)
    kk = tl.arange(0, BK)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    k_mask = kk < DK
    v_mask = vv < DV
    rows = tt[:, None]
    cols = tt[None, :]
    eye = tl.where(rows == cols, 1.0, 0.0)
    where = state_ptr + slot.to(tl.int64) * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s_mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(where, mask=s_mask, other=0.0)  # [BK, BV]
    for c0 in range(0, T, BT):
        t = c0 + tt
        t_mask = t < T  # the tokens past T: q = k = v = 0, beta = 0, which leave everything as it is
        qk_mask = t_mask[:, None] & k_mask[None, :]
        q = tl.load(q_ptr + t[:, None] * stride_qt + hk * stride_qh + kk[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + t[:, None] * stride_qt + hk * stride_qh + kk[None, :], mask=qk_mask, other=0.0)
        v = tl.load(v_ptr + t[:, None] * stride_vt + hv * stride_vh + vv[None, :],
                    mask=t_mask[:, None] & v_mask[None, :], other=0.0)  # fmt: skip
        G = tl.load(gc_ptr + t * stride_gt + hv, mask=t_mask, other=0.0)
        beta = tl.load(beta_ptr + t * stride_gt + hv, mask=t_mask, other=0.0)
        both = t_mask[:, None] & t_mask[None, :]
        # exp(G_t - G_i) where i <= t (elsewhere it may overflow: never multiplied, only discarded)
        decay = tl.where((cols <= rows) & both, tl.exp(G[:, None] - G[None, :]), 0.0)
        a = tl.where(cols < rows, decay, 0.0) * beta[:, None] * tl.dot(k, tl.trans(k), input_precision="ieee")
        inv = eye  # (I + A)^-1 by forward substitution: row i = e_i - A[i, :i] inv[:i]
        for i in range(1, BT):
            a_i = tl.reduce(tl.where(rows == i, a, 0.0), 0, tl.standard._sum_combine)
            inv = inv - tl.where(
                rows == i, tl.reduce(a_i[:, None] * inv, 0, tl.standard._sum_combine)[None, :], 0.0
            )
        w = tl.dot(inv, beta[:, None] * tl.exp(G)[:, None] * k, input_precision="ieee")  # [BT, BK]
        u = tl.dot(inv, beta[:, None] * v, input_precision="ieee") - tl.dot(w, s, input_precision="ieee")
        scores = decay * tl.dot(q, tl.trans(k), input_precision="ieee")
        o = tl.dot(tl.exp(G)[:, None] * q, s, input_precision="ieee") + tl.dot(
            scores, u, input_precision="ieee"
        )
        tl.store(o_ptr + t[:, None] * stride_ot + hv * stride_oh + vv[None, :], o,
                 mask=t_mask[:, None] & v_mask[None, :])  # fmt: skip
        last = tl.reduce(tl.where(tt == tl.minimum(T - c0, BT) - 1, G, 0.0), 0, tl.standard._sum_combine)
        kd = k * tl.exp(last - G)[:, None]
        s = tl.exp(last) * s + tl.dot(tl.trans(kd), u, input_precision="ieee")
    tl.store(where, s, mask=s_mask)


@functools.cache
def _kernel(interpret: bool, which: str = "decode") -> Any:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    return (InterpretedFunction if interpret else JITFunction)(
        _decode_step if which == "decode" else _prefill
    )


def _checked(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rule's inputs, contiguous (the kernels index them by their leading strides only).

    Raises:
        ValueError: an input or the state is not fp32, or the state is not contiguous (it is updated in place).
    """
    if any(x.dtype != torch.float32 for x in (q, k, v, g, beta, state)) or not state.is_contiguous():
        raise ValueError("the DeltaNet kernels take fp32 inputs and a contiguous fp32 state")
    return tuple(x.contiguous() for x in (q, k, v, g, beta))


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
    q, k, v, g, beta = _checked(q, k, v, g, beta, state)
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


PREFILL_CHUNK = 16  # tokens a chunk: the within-chunk solve is BT steps of BT x BT work


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot: int,
) -> torch.Tensor:
    """One sequence's tokens: q, k [T, H_k, d_k] (normalised), v [T, H_v, d_v], g and beta [T, H_v], all fp32;
    state [S, H_v, d_k, d_v] fp32, row `slot` continued and updated in place -> o [T, H_v, d_v] fp32. The chunked
    (WY) form of backends/torch/deltanet.py, PREFILL_CHUNK tokens at a time."""
    t, n_v, d_v = v.shape
    n_k, d_k = q.shape[1], q.shape[2]
    q, k, v, g, beta = _checked(q, k, v, g, beta, state)
    bt = PREFILL_CHUNK
    pad = -t % bt  # g's running sum within each chunk (the kernel reads it by token)
    gc = torch.nn.functional.pad(g, (0, 0, 0, pad)).view(-1, bt, n_v).cumsum(1).view(-1, n_v)[:t].contiguous()
    out = torch.empty_like(v)
    if t == 0:
        return out
    bk = max(16, 1 << (d_k - 1).bit_length())
    bv = 16  # with 8 warps, the fewest spills measured on sm_90 at d_k = 128: a 480-byte stack (32 and 4: 4 KiB)
    _kernel(q.device.type == "cpu", "prefill")[(n_v, (d_v + bv - 1) // bv)](
        q, k, v, gc, beta, state, out, slot, t, n_v // n_k, d_k, d_v,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), gc.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        BT=bt, BK=bk, BV=bv, num_warps=8,
    )  # fmt: skip
    return out
