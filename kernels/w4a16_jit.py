"""The Triton kernel bodies of the W4A16 path (GEMM / split-K GEMV, split-K sum, dequantize), on Marlin words.

Layout inversion (vLLM gptq_marlin_repack.cu; docs/marlin.md, "Closed form", "8-bit words"). One k-tile row of
`qweight` holds, per 64-column tile, 32*bits words; word j of 4-bit tile `nt` is `128 nt + 16 l8 + 4 l4 + w`
(lane = 4 l8 + l4, warp w) and its slot p = 4 p2 + 2 p1 + p0 holds Q[16t + 2 l4 + 8 p0 + p2, 64 nt + 16 w + l8 +
8 p1]. For 8-bit, word `256 nt + 32 l8 + 8 l4 + 2 w + h`, slot s = 2 s1 + s0 holds Q[16t + 2 l4 + 8 s0 + s1,
64 nt + 16 w + l8 + 8 h]. So the kernels load a word tile with rows (t, l4) and columns (nt, l8, w[, h]) with
plain strided loads, and each of the 4 "k slot pairs" (p0, p2) / (s0, s1) is a [BLOCK_K/4, BLOCK_N] sub-tile
whose rows are k indices and whose columns are n indices. Neither axis needs to be contiguous: the dot product
gathers the matching activation columns (which also applies act-order's perm for free) and the epilogue
stores each accumulator column at its own n. No shuffles, no precomputed tables.

The kernels call only Triton builtins and our own helper, not tl.sum / tl.zeros / tl.cdiv / tl.interleave,
which are themselves @triton.jit functions wrapped when triton is imported: Triton's interpreter cannot call
those if triton was imported before TRITON_INTERPRET=1 was set, and calling them interpreted leaves
triton.language patched for any later GPU compile in the process. (The FMA path's tl.reduce gets triton's own
_sum_combine, which the interpreter recognises and maps to numpy.sum without calling it.) Our helper,
_marlin_columns, is wrapped at call time like the kernels, so both orders work.

Dequantization is exact: `(q | 0x4B000000)` read as fp32 is 2^23 + q, so `- (2^23 + zero)` gives q - zero in
one subtract, and the scale is applied after the dot product whenever a K block lies in one group (scales
then multiply BLOCK_M x BLOCK_N accumulators instead of BLOCK_K x BLOCK_N weights, and the dot sees small
exact integers, which keeps bf16 accurate). Accumulation is fp32 throughout.
"""

from __future__ import annotations

import functools
from typing import Any

# triton.language, bound by _jit_kernels() on first use: importing this module never imports triton.
tl: Any = None


def _marlin_columns(pid_n, N, BITS: tl.constexpr, SCALE_SINGLE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The column half of the Marlin layout inversion for the BLOCK_N-wide tile `pid_n`, shared by every kernel.

    Returns (wcol, c_mask, n, n_mask, col_shift, spos, zword, zshift):
      wcol, c_mask: the word-tile columns (nt, l8, w[, h]) to load from a qweight row, and which exist;
      n, n_mask: the output column of each accumulator column j (4-bit words are interleaved twice, so
        j % 2 picks slot pair p1 and col_shift the matching 8-bit shift);
      spos: where column n's scale sits after marlin_permute_scales (8x8 transpose per 64, or
        scale_perm_single per 32);
      zword, zshift: the int32 word and bit offset of column n's zero point after marlin_zero_points (the
        64-chunk transpose, then the dequantizer interleave, then packing).
    """
    c = tl.arange(0, BLOCK_N * BITS // 8)  # word-tile column = (nt, l8, w[, h])
    if BITS == 4:
        wcol = (c // 32) * 128 + ((c // 4) % 8) * 16 + c % 4
    else:
        wcol = (c // 64) * 256 + ((c // 8) % 8) * 32 + ((c // 2) % 4) * 2 + c % 2
    wcol += pid_n * (BLOCK_N // 64) * (32 * BITS)
    # Runs of BITS words (w[, h]) are contiguous and aligned: 16/32-byte loads (cp.async.cg 16 on sm90).
    wcol = tl.max_contiguous(tl.multiple_of(wcol, BITS), BITS)
    c_mask = pid_n * (BLOCK_N // 64) + c // (8 * BITS) < N // 64
    j = tl.arange(0, BLOCK_N)
    if BITS == 4:
        cw = j // 2
        n = pid_n * BLOCK_N + (cw // 32) * 64 + (cw % 4) * 16 + (cw // 4) % 8 + (j % 2) * 8
        col_shift = (j % 2) * 8
    else:
        n = pid_n * BLOCK_N + (j // 64) * 64 + ((j // 2) % 4) * 16 + (j // 8) % 8 + (j % 2) * 8
        col_shift = j * 0
    n_mask = n < N
    if SCALE_SINGLE:
        spos = (n // 32) * 32 + ((n % 8) // 2) * 8 + ((n % 32) // 8) * 2 + n % 2
    else:
        spos = (n // 64) * 64 + (n % 8) * 8 + (n % 64) // 8
    zq = (n // 64) * 64 + (n % 8) * 8 + (n % 64) // 8
    if BITS == 4:
        zword = zq // 8
        zshift = (4 * (zq % 2) + (zq % 8) // 2) * 4
    else:
        zword = zq // 4
        zshift = (2 * (zq % 2) + (zq % 4) // 2) * 8
    return wcol, c_mask, n, n_mask, col_shift, spos, zword, zshift


# The plain function; _jit_kernels binds the name `_marlin_columns`, which the kernels call, to its Triton wrapper.
_MARLIN_COLUMNS = _marlin_columns


def _w4a16_gemm(
    x_ptr, qw_ptr, s_ptr, zp_ptr, gidx_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, stride_qw, group_size, blocks_per_split,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUP_MODE: tl.constexpr, SCALE_SINGLE: tl.constexpr, USE_DOT: tl.constexpr,
    W_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x[M, K] @ W; program (m, n, split) covers BLOCK_M x BLOCK_N and a slice of K blocks.

    PARTIAL: out is an fp32 workspace [split, M, N] and each split stores its own partial sum (_splitk_sum adds
    them up and the bias): no zero-fill, no atomics, the same bits on every run.

    GROUP_MODE 0: one group (per-channel), scale after the K loop; 1: every K block inside one group, scale
    per block; 2: scales gathered per (k, n) (act-order with uneven groups, or group < BLOCK_K).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    r = tl.arange(0, BLOCK_K // 4)  # word-tile row = (t, l4)
    t = r // 4
    l4 = r % 4
    wcol, c_mask, n, n_mask, col_shift, spos, zword, zshift = _marlin_columns(
        pid_n, N, BITS, SCALE_SINGLE, BLOCK_N
    )
    zp_stride = N * BITS // 32
    if GROUP_MODE == 0:
        s_row = tl.load(s_ptr + spos, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZP:
            z_row = tl.load(zp_ptr + zword, mask=n_mask, other=0)
            z_row = ((z_row >> zshift) & ((1 << BITS) - 1)).to(tl.float32) + 8388608.0
        else:
            z_row = tl.full([BLOCK_N], 8388608.0 + (1 << (BITS - 1)), tl.float32)

    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    kb_lo = pid_k * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, (K + BLOCK_K - 1) // BLOCK_K)
    for kb in range(kb_lo, kb_hi):
        kt = kb * (BLOCK_K // 16) + t
        r_mask = kt < K // 16
        wptr = qw_ptr + (kt * stride_qw + l4 * BITS)[:, None] + wcol[None, :]
        words = tl.load(wptr, mask=r_mask[:, None] & c_mask[None, :], other=0)
        if BITS == 4:
            # Interleave every word with itself: its slot pairs p1 = 0 / 1 feed columns n and n + 8.
            words = tl.reshape(tl.join(words, words), [BLOCK_K // 4, BLOCK_N])
        if GROUP_MODE == 1:
            g = (kb * BLOCK_K) // group_size
            s_row = tl.load(s_ptr + g * N + spos, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_ZP:
                z_row = tl.load(zp_ptr + g * zp_stride + zword, mask=n_mask, other=0)
                z_row = ((z_row >> zshift) & ((1 << BITS) - 1)).to(tl.float32) + 8388608.0
            else:
                z_row = tl.full([BLOCK_N], 8388608.0 + (1 << (BITS - 1)), tl.float32)
            part = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        else:
            part = acc
        for kq in tl.static_range(4):
            kk = kt * 16 + l4 * 2 + (kq // 2) * 8 + kq % 2  # packed row of this slot pair, [BLOCK_K/4]
            kx = tl.load(perm_ptr + kk, mask=r_mask, other=0) if HAS_PERM else kk
            xs = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            q = (words >> ((kq // 2) * BITS + (kq % 2) * 16 + col_shift[None, :])) & ((1 << BITS) - 1)
            wf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q, exactly
            if GROUP_MODE == 2:
                g2 = tl.load(gidx_ptr + kk, mask=r_mask, other=0) if HAS_GIDX else kk // group_size
                gmask = r_mask[:, None] & n_mask[None, :]
                s2 = tl.load(s_ptr + g2[:, None] * N + spos[None, :], mask=gmask, other=0.0).to(tl.float32)
                if HAS_ZP:
                    z2 = tl.load(zp_ptr + g2[:, None] * zp_stride + zword[None, :], mask=gmask, other=0)
                    z2 = ((z2 >> zshift[None, :]) & ((1 << BITS) - 1)).to(tl.float32) + 8388608.0
                    b = (wf - z2) * s2
                else:
                    b = (wf - (8388608.0 + (1 << (BITS - 1)))) * s2
            else:
                b = wf - z_row[None, :]  # q - zero, a small exact integer in any float type
            if USE_DOT:
                if W_FP32:
                    xs = xs.to(tl.float32)
                part = tl.dot(xs, b.to(xs.dtype), part, input_precision=DOT_PRECISION)
            else:  # tiny M: CUDA-core FMAs, no tensor-core operand shuffles
                part += tl.reduce(xs.to(tl.float32)[:, :, None] * b[None, :, :], 1, tl.standard._sum_combine)
        if GROUP_MODE == 1:
            acc += part * s_row[None, :]
        else:
            acc = part
    if GROUP_MODE == 0:
        acc = acc * s_row[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    optrs = out_ptr + offs_m[:, None] * stride_om + n[None, :]
    if PARTIAL:
        optrs += pid_k * (M * N)
    tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _splitk_sum(ws_ptr, bias_ptr, out_ptr, MN, N, split, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[M, N] = sum over splits of ws[split, M, N] (+ bias), in fixed order, cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for i in range(1, split):
        acc += tl.load(ws_ptr + i * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _marlin_dequant(
    qw_ptr, s_ptr, zp_ptr, gidx_ptr, perm_ptr, w_ptr, N, K, stride_qw, group_size,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_GIDX: tl.constexpr,
    SCALE_SINGLE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """w[K, N] = dense weight in natural row order (row perm[k] for packed row k): same index maths as the GEMM."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = tl.arange(0, BLOCK_K // 4)
    t = r // 4
    l4 = r % 4
    wcol, c_mask, n, n_mask, col_shift, spos, zword, zshift = _marlin_columns(
        pid_n, N, BITS, SCALE_SINGLE, BLOCK_N
    )
    kt = pid_k * (BLOCK_K // 16) + t
    r_mask = kt < K // 16
    wptr = qw_ptr + (kt * stride_qw + l4 * BITS)[:, None] + wcol[None, :]
    words = tl.load(wptr, mask=r_mask[:, None] & c_mask[None, :], other=0)
    if BITS == 4:
        words = tl.reshape(tl.join(words, words), [BLOCK_K // 4, BLOCK_N])
    gmask = r_mask[:, None] & n_mask[None, :]
    for kq in tl.static_range(4):
        kk = kt * 16 + l4 * 2 + (kq // 2) * 8 + kq % 2
        g = tl.load(gidx_ptr + kk, mask=r_mask, other=0) if HAS_GIDX else kk // group_size
        q = (words >> ((kq // 2) * BITS + (kq % 2) * 16 + col_shift[None, :])) & ((1 << BITS) - 1)
        wf = (q | 0x4B000000).to(tl.float32, bitcast=True)
        s = tl.load(s_ptr + g[:, None] * N + spos[None, :], mask=gmask, other=0.0).to(tl.float32)
        if HAS_ZP:
            z = tl.load(zp_ptr + g[:, None] * (N * BITS // 32) + zword[None, :], mask=gmask, other=0)
            z = ((z >> zshift[None, :]) & ((1 << BITS) - 1)).to(tl.float32) + 8388608.0
        else:
            z = 8388608.0 + (1 << (BITS - 1))
        row = tl.load(perm_ptr + kk, mask=r_mask, other=0) if HAS_PERM else kk
        val = (wf - z) * s
        tl.store(w_ptr + row[:, None] * N + n[None, :], val.to(w_ptr.dtype.element_ty), mask=gmask)


def sum_splits(ws: Any, bias: Any, out: Any, interpret: bool) -> None:
    """out [M, N] = the sum of the split-K partials ws [split, M, N] (+ bias [N]), in fixed order."""
    split, m, n = ws.shape
    block = 1024
    _, _, splitk_sum = _jit_kernels(interpret)
    splitk_sum[(-(-m * n // block),)](
        ws, ws if bias is None else bias, out, m * n, n, split,
        HAS_BIAS=bias is not None, BLOCK=block, enable_fp_fusion=True,
    )  # fmt: skip


def _jit_kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """(gemm, dequant, split-K sum) as Triton functions, wrapped on first use (never at import) and keyed by the
    flag, so TRITON_INTERPRET is honoured at call time even when triton was imported before it was set. The
    shared index helper is bound to the same kind of wrapper, under the name the kernels call it by."""
    kernels, columns = _wrapped(interpret)
    globals()["_marlin_columns"] = columns
    return kernels


@functools.cache
def _wrapped(interpret: bool) -> tuple[tuple[Any, Any, Any], Any]:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    wrap = InterpretedFunction if interpret else JITFunction
    return (wrap(_w4a16_gemm), wrap(_marlin_dequant), wrap(_splitk_sum)), wrap(_MARLIN_COLUMNS)
