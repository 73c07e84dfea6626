"""MXFP4 weights (OCP Microscaling, as gpt-oss ships its experts): 4-bit e2m1 values, 32 to a block that shares one
e8m0 power-of-two scale. Read as they ship, never expanded at load.

Layout (gpt-oss's checkpoints; transformers' integrations/mxfp4.py reads the same): a weight W [N, K] is
- `blocks` uint8 [N, K / 32, 16]: byte j of a block holds element 2j in its low nibble and 2j + 1 in its high one;
- `scales` uint8 [N, K / 32]: block b of row n is multiplied by 2^(scales[n, b] - 127).
A nibble is sign (bit 3), exponent (bits 2..1) and mantissa (bit 0): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives. Every value is exact in bf16 and fp32, and so is its product with the scale (a power of two), so
dequantizing to them loses nothing (fp16 holds the products only within its narrower exponent range).

Two ways to multiply: `mxfp4_linear_ref` dequantizes the weight (a transient, one expert at a time) and runs a
matmul: the CPU path and the tests' reference. `mxfp4_linear` is a Triton GEMM that decodes the nibbles in
registers (W4A16-style: the activations stay in their dtype, the accumulation is fp32). It splits the activations
into even and odd columns, so that each byte's low and high nibbles meet their own column without an interleave.
Like w4a16_jit.py, the kernel calls only Triton builtins and is wrapped at first call, keyed by the interpreter.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

tl: Any = None  # triton.language, bound on first use: importing this module never imports triton

BLOCK = 32  # values per scale
# e2m1 nibble -> value (transformers' FP4_VALUES; the OCP MX spec's table)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_shapes(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """Raise ValueError naming `name` unless blocks [..., N, K/32, 16] uint8 and scales [..., N, K/32] uint8
    agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match; blocks are "
            f"[..., N, K/32, 16] and scales [..., N, K/32]"
        )


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W [..., N, K] in `dtype` from blocks [..., N, K/32, 16] and scales [..., N, K/32] (exact)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    vals = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., K/32, 16, 2]
    vals = vals.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]
    return vals.flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of W [..., N, K] (K a multiple of 32): each block's scale is the smallest power of two
    that brings its largest magnitude within 6, and each value rounds to the nearest e2m1 value (ties to the
    lower magnitude). For building test checkpoints and for the quantizers; the released models were quantized
    by their makers."""
    *lead, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs K a multiple of {BLOCK}, got {k}")
    g = w.float().reshape(*lead, k // BLOCK, BLOCK)
    amax = g.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scales = (exp + 127).to(torch.uint8)
    mags = torch.tensor(FP4_VALUES[:8], device=w.device)
    x = g / torch.exp2(exp)[..., None]
    idx = (x.abs()[..., None] - mags).abs().argmin(-1)  # the nearest magnitude, the lower one on a tie
    codes = (idx | ((x < 0) & (idx > 0)).long() << 3).to(torch.uint8)  # no negative zero
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.reshape(*lead, k // BLOCK, BLOCK // 2), scales


@dataclass(frozen=True)
class Mxfp4Weight:
    """One linear's MXFP4 weight W [N, K], laid out as above (compressed-tensors' `mxfp4-pack-quantized` stores the
    same bytes as `weight_packed` [N, K/2] and `weight_scale` [N, K/32])."""

    blocks: torch.Tensor
    scales: torch.Tensor

    bits = 4

    @property
    def N(self) -> int:  # noqa: N802 - GEMM letters
        return self.blocks.shape[0]

    @property
    def K(self) -> int:  # noqa: N802
        return self.blocks.shape[1] * BLOCK

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[K, N], the orientation QuantizedWeight.dequantize returns (exact in fp32 and bf16)."""
        return dequantize(self.blocks, self.scales, dtype).t()


def mxfp4_linear_ref(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with W dequantized to x's dtype first: the CPU path and the reference."""
    out = x @ dequantize(blocks, scales, x.dtype).T
    return out if bias is None else out + bias.to(x.dtype)


def _weight(code, scale, x, F32_DOT: tl.constexpr):
    """The values of e2m1 nibbles `code` times their blocks' `scale`, in the dot's dtype (exact either way)."""
    e = (code >> 1) & 3
    frac = (code & 1).to(tl.float32) * 0.5
    mag = tl.where(e == 0, frac, (1.0 + frac) * tl.exp2(e.to(tl.float32) - 1.0))
    w = tl.where((code & 8) != 0, -mag, mag) * scale
    return w if F32_DOT else w.to(x.dtype)


def _act(x, F32_DOT: tl.constexpr):
    return x.to(tl.float32) if F32_DOT else x


def _mxfp4_gemm(
    x_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_bn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for one BLOCK_M x BLOCK_N tile; BLOCK_K a multiple of 32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_K // 2)  # byte columns: values 2j (low nibble) and 2j + 1 (high)
    m_mask = m < M
    n_mask = n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + 2 * j
        k_mask = kk < K
        xe = tl.load(
            x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        xo = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :] + 1, mask=m_mask[:, None] & k_mask[None, :],
                     other=0.0)  # fmt: skip
        wmask = k_mask[:, None] & n_mask[None, :]
        byte = tl.load(
            b_ptr + n[None, :] * stride_bn + (k0 // 2 + j)[:, None], mask=wmask, other=0
        )  # [BK/2, BN]
        sc = tl.load(s_ptr + n[None, :] * stride_sn + (kk // 32)[:, None], mask=wmask, other=127)
        scale = tl.exp2(sc.to(tl.float32) - 127.0)
        lo = byte & 0x0F
        hi = byte >> 4
        acc += tl.dot(_act(xe, F32_DOT), _weight(lo, scale, xe, F32_DOT), input_precision=DOT_PRECISION,
                      out_dtype=tl.float32)  # fmt: skip
        acc += tl.dot(_act(xo, F32_DOT), _weight(hi, scale, xo, F32_DOT), input_precision=DOT_PRECISION,
                      out_dtype=tl.float32)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


def _mxfp4_moe_gemm(
    x_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, rw_ptr, slots_ptr, expert_ptr, npad_ptr, N, K, n_slots, top_k,
    stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, GATHER_TOKENS: tl.constexpr, ROUTED_WEIGHT: tl.constexpr, F32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Every expert's slots at once (w4a16_moe.py's layout): out[slot, n] = x[row(slot)] W_e[n] (+ bias_e[n]),
    times the slot's routed weight, for the BLOCK_M slots of this block, all of expert e; W_e is expert e's MXFP4
    weight, decoded as _mxfp4_gemm decodes it."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slots < n_slots  # padding holds n_slots
    rows = (slots // top_k if GATHER_TOKENS else slots).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    j = tl.arange(0, BLOCK_K // 2)
    b_e = b_ptr + e * N * (K // 2)  # expert e's [N, K/32, 16] bytes and [N, K/32] scales
    s_e = s_ptr + e * N * (K // 32)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + 2 * j
        k_mask = kk < K
        xmask = m_mask[:, None] & k_mask[None, :]
        xe = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0)
        xo = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :] + 1, mask=xmask, other=0.0)
        wmask = k_mask[:, None] & n_mask[None, :]
        byte = tl.load(b_e + n[None, :] * (K // 2) + (k0 // 2 + j)[:, None], mask=wmask, other=0)
        sc = tl.load(s_e + n[None, :] * (K // 32) + (kk // 32)[:, None], mask=wmask, other=127)
        scale = tl.exp2(sc.to(tl.float32) - 127.0)
        acc += tl.dot(_act(xe, F32_DOT), _weight(byte & 0x0F, scale, xe, F32_DOT), input_precision=DOT_PRECISION,
                      out_dtype=tl.float32)  # fmt: skip
        acc += tl.dot(_act(xo, F32_DOT), _weight(byte >> 4, scale, xo, F32_DOT), input_precision=DOT_PRECISION,
                      out_dtype=tl.float32)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * N + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ROUTED_WEIGHT:
        acc *= tl.load(rw_ptr + slots, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + slots[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


# The plain helpers; _kernel binds the names the kernels call them by to their Triton wrappers.
_HELPERS = {"_weight": _weight, "_act": _act}


def _kernel(interpret: bool, name: str = "gemm") -> Any:
    """A kernel ("gemm" or "moe") as a Triton function, wrapped on first use and keyed by the interpreter flag
    (as w4a16_jit.py), its helpers bound to the same kind of wrapper under the names it calls."""
    kernels, helpers = _wrapped(interpret)
    globals().update(helpers)
    return kernels[name]


@functools.cache
def _wrapped(interpret: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    wrap = InterpretedFunction if interpret else JITFunction
    kernels = {"gemm": wrap(_mxfp4_gemm), "moe": wrap(_mxfp4_moe_gemm)}
    return kernels, {name: wrap(fn) for name, fn in _HELPERS.items()}


def can_run(device: torch.device) -> bool:
    """Whether the Triton kernel runs on `device`: CUDA, or the CPU under TRITON_INTERPRET=1 (tests)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    interpreting = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    return device.type == "cuda" or (device.type == "cpu" and interpreting)


def mxfp4_linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) @ W^T (+ bias) -> [M, N] in x's dtype, W read as MXFP4 in the kernel."""
    n, kb, _ = blocks.shape
    k = kb * BLOCK
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns but the MXFP4 weight has K = {k}")
    x, blocks, scales = (
        x.contiguous(),
        blocks.contiguous(),
        scales.contiguous(),
    )  # rows of K/2 bytes, K/32 scales
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    interp = x.device.type == "cpu"
    block_m = 16 if x.shape[0] <= 16 else 64
    grid = ((x.shape[0] + block_m - 1) // block_m, (n + 63) // 64)
    _kernel(interp)[grid](
        x, blocks, scales, bias if bias is not None else x, out, x.shape[0], n, k,
        x.stride(0), blocks.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, F32_DOT=interp and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interp else "tf32",
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4,
    )  # fmt: skip
    return out


def mxfp4_moe_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    top_k: int,
    out_rows: int,
    routed_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert's MXFP4 matmul in one launch: [out_rows, N] in x's dtype, row `slot` x[slot // top_k] (top_k
    > 0: x holds the tokens) or x[slot] (top_k == 0: a row per slot) times W_e^T, plus bias[e], times
    routed_weights[slot] when given; e is the slot's expert. blocks [E, N, K/32, 16] and scales [E, N, K/32] as
    gpt-oss ships them, bias [E, N]; `aligned` is align_by_expert(topk_ids, E, block_m) (kernels/w4a16_moe.py),
    block_m at least 16 (a tensor-core tile)."""
    check_shapes(blocks, scales, "experts")
    n_exp, n, kb, _ = blocks.shape
    k = kb * BLOCK
    if x.shape[-1] != k or block_m < 16 or (bias is not None and tuple(bias.shape) != (n_exp, n)):
        raise ValueError(f"x has {x.shape[-1]} columns for K = {k}, block_m {block_m} must be at least 16, and "
                         f"bias must be [{n_exp}, {n}]")  # fmt: skip
    sorted_slots, block_expert, n_padded = aligned
    if sorted_slots.numel() % block_m or block_expert.numel() != sorted_slots.numel() // block_m:
        raise ValueError(f"`aligned` is not align_by_expert's output for block_m {block_m}")
    x, blocks, scales = x.contiguous(), blocks.contiguous(), scales.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(out_rows, n, device=x.device, dtype=x.dtype)  # every slot's row is written once
    interp = x.device.type == "cpu"
    rw = routed_weights.reshape(-1).contiguous() if routed_weights is not None else sorted_slots
    grid = (sorted_slots.numel() // block_m, -(-n // 64))
    _kernel(interp, "moe")[grid](
        x, blocks, scales, bias if bias is not None else x, out, rw, sorted_slots, block_expert, n_padded, n, k,
        out_rows, max(top_k, 1), x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GATHER_TOKENS=top_k > 0, ROUTED_WEIGHT=routed_weights is not None,
        F32_DOT=interp and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interp else "tf32",
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4 if block_m <= 32 else 8,
    )  # fmt: skip
    return out
