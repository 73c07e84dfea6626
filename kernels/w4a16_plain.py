"""Triton W4A16 / W8A16 on a K-packed copy of a Marlin weight, made once at load: the fast path on CUDA.

The Marlin layout (marlin.py) is what checkpoints and vLLM's CUDA kernel use. Its 16 x 64 tiles interleave k and n
inside every word, which suits Marlin's own warp-level loads but not Triton's: the first Triton kernels
(w4a16_jit.py) had to read it as small strided pieces and gather activation columns per slot, and on an H100
they ran at a third of tinygemm's speed at M = 1 and a tenth of cuBLAS fp16 at M = 128 (bench/results/gpu-*).
So `prepare_plain` unpacks the Marlin weight once and packs it along K instead:

- `qweight` int32 [K / P, N], P = 32 / bits values per word: word (r, n) holds q[P r + i, n] in bits
  [bits i, bits (i + 1)). Rows keep Marlin's packed order: with act-order they are sorted by group, so every
  group is a run of consecutive rows, and the activations are permuted once per call instead (x[:, perm]).
- `scales` [n_groups, N] and `zeros` (uint8 [n_groups, N], asymmetric only) in natural column order.

A program loads [BLOCK_K / P, BLOCK_N] words (rows of contiguous int32 along N, coalesced), shifts them into
[BLOCK_K, BLOCK_N] codes, subtracts the zero point (small integers, exact in fp16 and bf16), multiplies with
x [BLOCK_M, BLOCK_K] by tl.dot (or by FMAs at M = 1), and scales the [BLOCK_M, BLOCK_N] partial product by the
block's group, so no dequantized weight is ever rounded to half precision. BLOCK_K divides the group size; split-K
(fp32 partials, summed by w4a16_jit's _splitk_sum) keeps the small-M launches wide.

Weights whose groups are uneven after sorting (act-order with irregular g_idx), or shorter than 32 rows, keep the
Marlin-layout kernels. Like w4a16_jit.py, the kernel calls only Triton builtins and is wrapped at first call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .marlin import MarlinWeight, marlin_unpack, marlin_unpack_zero_points, marlin_unpermute_scales

tl: Any = None  # triton.language, bound on first use


@dataclass(frozen=True)
class PlainState:
    """A weight in the K-packed layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 [K / (32 / bits), N]
    scales: torch.Tensor  # [n_groups, N], natural column order, the checkpoint's float type
    zeros: torch.Tensor | None  # uint8 [n_groups, N], or None (symmetric: zero = 2^(bits - 1))
    perm: torch.Tensor | None  # int64 [K]: row k of qweight is input column perm[k] (act-order)
    bits: int
    group: int  # rows per group in packed order (K for per-channel)
    K: int  # noqa: N815 - GEMM letters
    N: int  # noqa: N815


@dataclass(frozen=True)
class PlainConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    use_dot: bool = True
    num_warps: int = 4
    num_stages: int = 4


def plain_group(mw: MarlinWeight) -> int | None:
    """Rows per group in packed order when every group is one run of rows of a length the kernel takes (a
    multiple of 32, or the whole K); None otherwise."""
    k = mw.K
    group = k if mw.group_size == -1 or mw.group_size >= k else mw.group_size
    if group != k and group % 32:
        return None
    if mw.g_idx is not None:
        trivial = torch.arange(k, device=mw.g_idx.device) // group
        if not torch.equal(mw.g_idx.long(), trivial):
            return None
    return group


def prepare_plain(mw: MarlinWeight) -> PlainState | None:
    """The K-packed copy of `mw`, on its device, or None when its groups do not suit the kernel."""
    group = plain_group(mw)
    if group is None:
        return None
    k, n, bits = mw.K, mw.N, mw.bits
    per = 32 // bits
    q = marlin_unpack(mw.qweight, k, n, bits).to(torch.int32)  # [K, N], packed row order
    shifts = (torch.arange(per, device=q.device, dtype=torch.int32) * bits)[None, :, None]
    words = (q.view(k // per, per, n) << shifts).sum(1, dtype=torch.int32)
    zeros = None if mw.zeros is None else marlin_unpack_zero_points(mw.zeros, k, n, bits).contiguous()
    return PlainState(
        qweight=words.contiguous(),
        scales=marlin_unpermute_scales(mw.scales, k, n, mw.group_size).contiguous(),
        zeros=zeros,
        perm=None if mw.perm is None else mw.perm.to(torch.int64).contiguous(),
        bits=bits,
        group=group,
        K=k,
        N=n,
    )


def default_plain_config(m: int, k: int, n: int, group: int, sm_count: int = 0) -> PlainConfig:
    """Launch config by M bucket. BLOCK_K divides the group (or the whole K for per-channel weights); split-K
    brings small-M grids to about four programs per SM."""
    block_k = next(b for b in (128, 64, 32) if group % b == 0 or group == k and b == 128)
    if m == 1:
        block_m, use_dot, warps, block_n = 1, False, 4, 128
    elif m <= 16:
        block_m, use_dot, warps, block_n = 16, True, 4, 128
    elif m <= 64:
        block_m, use_dot, warps, block_n = (32 if m <= 32 else 64), True, 4, 128
    else:
        block_m, use_dot, warps, block_n = 128, True, 8, 128
        block_k = min(block_k, 64)
    tiles = -(-m // block_m) * -(-n // block_n)
    k_blocks = -(-k // block_k)
    split = 1
    if sm_count and tiles < 2 * sm_count:
        split = max(1, min(k_blocks, (4 * sm_count) // tiles))
        split = -(-k_blocks // -(-k_blocks // split))  # no empty splits
    return PlainConfig(block_m, block_n, block_k, split, use_dot, warps, 4 if m <= 16 else 3)


def _plain_gemm(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, group_size, blocks_per_split,
    BITS: tl.constexpr, PACK: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x[M, K] @ W for the (m, n) tile and the K blocks of split program_id(2); PACK = 32 / BITS."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // PACK)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = tl.arange(0, PACK) * BITS
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    kb_lo = pid_k * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, (K + BLOCK_K - 1) // BLOCK_K)
    for kb in range(kb_lo, kb_hi):
        rows = kb * (BLOCK_K // PACK) + offs_w
        words = tl.load(
            qw_ptr + rows[:, None] * N + offs_n[None, :],
            mask=(rows < K // PACK)[:, None] & n_mask[None, :],
            other=0,
        )
        # codes [BLOCK_K / PACK, PACK, BLOCK_N], then [BLOCK_K, BLOCK_N]: row P r + i is value i of word row r,
        # i.e. k = kb BLOCK_K + P r + i
        code_mask = (1 << BITS) - 1
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & code_mask, [BLOCK_K, BLOCK_N])
        g = (kb * BLOCK_K) // group_size
        if HAS_ZP:
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.int32)
            b = q - z[None, :]
        else:
            b = q - (1 << (BITS - 1))
        ks = kb * BLOCK_K + offs_k
        xs = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
            mask=m_mask[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        if USE_DOT:
            part = tl.dot(xs, b.to(xs.dtype), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:
            part = tl.reduce(
                xs.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1, tl.standard._sum_combine
            )
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    optrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if PARTIAL:
        optrs += pid_k * (M * N)
    tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _plain_dequant(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size,
    BITS: tl.constexpr, PACK: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """w[K, N] = the dense weight in packed row order, each row written contiguously; PACK = 32 / BITS."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = pid_k * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(
        qw_ptr + rows[:, None] * N + offs_n[None, :],
        mask=(rows < K // PACK)[:, None] & n_mask[None, :],
        other=0,
    )
    shifts = tl.arange(0, PACK) * BITS
    q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), [BLOCK_K, BLOCK_N])
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    g = ks // group_size
    mask = (ks < K)[:, None] & n_mask[None, :]
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.int32)
        val = (q - z).to(tl.float32) * s
    else:
        val = (q - (1 << (BITS - 1))).to(tl.float32) * s
    tl.store(w_ptr + ks[:, None] * N + offs_n[None, :], val.to(w_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _wrapped(interpret: bool) -> tuple[Any, Any]:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    wrap = InterpretedFunction if interpret else JITFunction
    return wrap(_plain_gemm), wrap(_plain_dequant)


def plain_gemm(
    x: torch.Tensor,
    state: PlainState,
    bias: torch.Tensor | None = None,
    config: PlainConfig | None = None,
    sm_count: int = 0,
    interpret: bool = False,
) -> torch.Tensor:
    """x [..., K] fp16 / bf16 / fp32 -> [..., N] in x.dtype (fp32 accumulation); `bias` natural order [N]."""
    from .w4a16_jit import sum_splits

    k, n = state.K, state.N
    x2 = x.reshape(-1, k)
    if state.perm is not None:
        x2 = x2.index_select(1, state.perm)
    elif x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    cfg = config or default_plain_config(m, k, n, state.group, sm_count)
    k_blocks = -(-k // cfg.block_k)
    per_split = -(-k_blocks // cfg.split_k)
    split = -(-k_blocks // per_split)
    partial = split > 1
    # The interpreter truncates fp32 -> bf16 and mishandles bf16 dots (see w4a16_triton.py): there bf16 stores
    # fp32 and dots in fp32 (exact: small integers times bf16 values), rounded by torch below.
    bf16_fix = interpret and x.dtype == torch.bfloat16
    if bf16_fix:
        x2 = x2.float()
    out = torch.empty(m, n, device=x2.device, dtype=torch.float32 if bf16_fix else x.dtype)
    ws = torch.empty(split, m, n, device=x2.device, dtype=torch.float32) if partial else out
    gemm, _ = _wrapped(interpret)
    dummy = state.qweight
    gemm[(-(-m // cfg.block_m), -(-n // cfg.block_n), split)](
        x2, state.qweight, state.scales, dummy if state.zeros is None else state.zeros,
        dummy if bias is None else bias, ws, m, n, k, x2.stride(0), n, state.group, per_split,
        BITS=state.bits, PACK=32 // state.bits, HAS_ZP=state.zeros is not None,
        HAS_BIAS=bias is not None and not partial,
        PARTIAL=partial, USE_DOT=cfg.use_dot, DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if partial:
        sum_splits(ws, bias, out, interpret)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def plain_dequantize(
    state: PlainState, dtype: torch.dtype = torch.float16, interpret: bool = False
) -> torch.Tensor:
    """The dense [K, N] weight in packed row order (x[:, perm] @ it is the product) in `dtype`."""
    k, n = state.K, state.N
    block_k, block_n = 64, 128
    bf16_fix = interpret and dtype == torch.bfloat16
    w = torch.empty(k, n, device=state.qweight.device, dtype=torch.float32 if bf16_fix else dtype)
    _, dequant = _wrapped(interpret)
    dummy = state.qweight
    dequant[(-(-k // block_k), -(-n // block_n))](
        state.qweight, state.scales, dummy if state.zeros is None else state.zeros, w, n, k, state.group,
        BITS=state.bits, PACK=32 // state.bits, HAS_ZP=state.zeros is not None, BLOCK_N=block_n,
        BLOCK_K=block_k,
    )  # fmt: skip
    return w.to(dtype)
