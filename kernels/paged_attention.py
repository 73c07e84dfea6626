"""Decode attention over a paged KV cache, reading each sequence's block table directly (vLLM's paged_attention).

One query token per sequence attends to its whole context, which lives in fixed-size blocks of the cache:
position p of sequence b is cache cell `block_tables[b, p // block_size] * block_size + p % block_size`. The
engine then needs no per-step gather of every context position (a [B, C] index built on the host, a K/V copy
per layer), and the inputs have fixed shapes (block tables padded to a width, lengths as a tensor), which is what a
CUDA graph needs: the loop bound is read from `context_lens` on the device.

A sliding window (Gemma, Mistral) starts the loop at the window's first position instead of 0, so a windowed layer
reads only `window` positions whatever the context; Gemma 2's soft cap bounds the scores by cap * tanh(s / cap)
before the softmax, in fp32. gpt-oss's sinks add one logit per head to the softmax's sum, after the loop.

One program per (sequence, KV head) computes all G = H / KV query heads of its group against one pass over the
group's keys and values (grouped-query attention reads each K/V once), BLOCK_N positions at a time, with the
online softmax of FlashAttention (running max and sum in fp32). The heads are padded to at least 16 rows so that
the score and value products are tensor-core dots.

Like w4a16_jit.py, the kernel calls only Triton builtins (tl.reduce with triton's own combine functions, which
the interpreter maps to numpy) and is wrapped at first call, keyed by TRITON_INTERPRET, so the CPU tests run it
interpreted whatever the import order.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

tl: Any = None  # triton.language, bound on first use: importing this module never imports triton


def _paged_decode(
    q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, sink_ptr, out_ptr,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_bt, stride_ob, stride_oh,
    scale, block_size, window, softcap,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """out[b, h] = softmax(cap(q[b, h] . K[b]^T * scale)) V[b] for the G query heads h of KV head program_id(1),
    over the last `window` positions of the context."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < G
    d_mask = d < D
    heads = kvh * G + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)
    ctx = tl.load(len_ptr + b)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(tl.maximum(ctx - window, 0), ctx, BLOCK_N):
        pos = start + n
        p_mask = pos < ctx
        blk = tl.load(bt_ptr + b * stride_bt + pos // block_size, mask=p_mask, other=0)
        cell = blk.to(tl.int64) * block_size + pos % block_size
        kv_off = cell[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if F32_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # scores [G_PAD, BLOCK_N]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32) * scale
        if (
            SOFTCAP
        ):  # cap * tanh(s / cap), tanh(x) = 2 / (1 + e^-2x) - 1 (no tanh among the interpreter's builtins)
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
        m_i = m_new
    if SINKS:  # one more logit per head in the softmax's sum, for no value: rescale to max(m, sink) first
        sink = tl.load(sink_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


@functools.cache
def _kernel(interpret: bool) -> Any:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    return (InterpretedFunction if interpret else JITFunction)(_paged_decode)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def can_run(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton kernel can run on `device`, and why not."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and _interpreting():
        return True, ""
    return False, f"{device.type} tensors (Triton runs on CUDA, or on the CPU only under TRITON_INTERPRET=1)"


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence over its paged context.

    Args:
        q: [B, H, D] queries (fp16, bf16 or fp32), H a multiple of the KV heads.
        k_cache, v_cache: [num_cells, KV, D] one layer's cache, same dtype as q; cell = block * block_size + offset.
        block_tables: int32 [B, W], each row the sequence's blocks in order (entries past its length unread).
        context_lens: int32 [B] positions to attend to, the new token's own included (>= 1).
        block_size: cache cells per block.
        scale: multiplies the scores (1 / sqrt(D) for plain attention).
        window: attend to the last `window` positions only (0: all of them).
        softcap: cap the scaled scores by softcap * tanh(s / softcap) (0: none).
        sinks: [H] one more logit per head in the softmax, attending to nothing (gpt-oss); None: none.

    Returns:
        [B, H, D] in q's dtype.
    """
    bsz, n_heads, dim = q.shape
    n_kv = k_cache.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv} KV heads")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous in their last dimension")
    groups = n_heads // n_kv
    out = torch.empty(bsz, n_heads, dim, device=q.device, dtype=q.dtype)
    if bsz == 0:
        return out
    # Triton's interpreter returns garbage from bf16 dots (see w4a16_triton.py): there they run in fp32, exactly.
    interp = q.device.type == "cpu"
    kernel = _kernel(interp)
    kernel[(bsz, n_kv)](
        q, k_cache, v_cache, block_tables, context_lens, sinks if sinks is not None else q, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), scale, block_size, window if window > 0 else 1 << 30, float(softcap or 1.0),
        G=groups, G_PAD=max(16, 1 << (groups - 1).bit_length()), D=dim, D_PAD=max(16, 1 << (dim - 1).bit_length()),
        BLOCK_N=block_n, F32_DOT=interp and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=bool(softcap),
        SINKS=sinks is not None, num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
