"""Fp8Weight: FP8 (e4m3) weights of one linear with their scales, as FP8 checkpoints store them.

One form for the three scale granularities checkpoints use (docs/quantized-checkpoints.md, "FP8"): a scale per
block of `block = (bn, bk)` weights, where one block spanning the matrix is a per-tensor scale and `(1, K)` a
per-output-channel one. A grid that does not divide the matrix has partial blocks at its right and bottom edges
(`scale[n // bn, k // bk]`, as vLLM indexes it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Fp8Weight:
    """`W[n, k] = weight[n, k] * scale[n // block[0], k // block[1]]`, in nn.Linear orientation.

    Attributes:
        weight: float8_e4m3fn [N, K].
        scale: float32 [ceil(N / block[0]), ceil(K / block[1])], what a checkpoint calls `weight_scale_inv`
            (native FP8) or `weight_scale` (compressed-tensors): it multiplies.
        block: (rows, columns) one scale covers.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    bits = 8

    @property
    def N(self) -> int:  # noqa: N802 - GEMM letters
        return self.weight.shape[0]

    @property
    def K(self) -> int:  # noqa: N802
        return self.weight.shape[1]

    def full_scale(self) -> torch.Tensor:
        """float32 [N, K]: each weight's scale."""
        bn, bk = self.block
        s = self.scale.float().repeat_interleave(bn, 0)[: self.N]
        return s.repeat_interleave(bk, 1)[:, : self.K]

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`, computed in fp32: exact, as every FP8 value times an fp32 scale is."""
        return (self.weight.float() * self.full_scale()).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[K, N], the orientation QuantizedWeight.dequantize returns, for the readers both share."""
        return self.dense(dtype).t()


# ---- the W8A16 GEMM ----------------------------------------------------------------------------------------------
#
# The weight stays FP8 in memory and is decoded in registers, tile by tile: its bytes are read as uint8 and the e4m3
# bits turned into values by arithmetic (sign, 4-bit exponent biased by 7, 3-bit mantissa; exponent 0 is subnormal),
# so the kernel needs no FP8 support from the GPU (sm80 has none) or from Triton's interpreter. Each value times its
# block's scale is exact in fp32; the dot runs in the activations' dtype (fp32 under the interpreter), accumulating in
# fp32. As mxfp4.py, the kernel calls only Triton builtins and is wrapped at first use, keyed by the interpreter.

tl: Any = None  # triton.language, bound on first use: importing this module never imports triton


def _e4m3(byte):
    """The fp32 values of e4m3 bytes (no NaN is expected in weights: 0x7F/0xFF decode as 480)."""
    e = ((byte >> 3) & 15).to(tl.float32)
    m = (byte & 7).to(tl.float32)
    mag = tl.where(e == 0.0, m * 0.001953125, (8.0 + m) * tl.exp2(e - 10.0))  # m 2^-9, or (1 + m/8) 2^(e-7)
    return tl.where((byte & 128) != 0, -mag, mag)


def _fp8_gemm(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum_k x[m, k] weight[n, k] scale[n // BLOCK_ROWS, k // BLOCK_COLS] (+ bias[n])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_mask = m < M
    n_mask = n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_mask = kk < K
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        wmask = k_mask[:, None] & n_mask[None, :]
        byte = tl.load(w_ptr + n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0)  # [BK, BN]
        scale = tl.load(s_ptr + (n // BLOCK_ROWS)[None, :] * stride_sn + (kk // BLOCK_COLS)[:, None], mask=wmask,
                        other=0.0)  # fmt: skip
        w = _e4m3(byte) * scale
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


def _kernel(interpret: bool) -> Any:
    kernel, helper = _wrapped(interpret)
    globals()["_e4m3"] = helper  # the name the kernel calls, bound to the same kind of wrapper
    return kernel


@functools.cache
def _wrapped(interpret: bool) -> tuple[Any, Any]:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    wrap = InterpretedFunction if interpret else JITFunction
    return wrap(_fp8_gemm), wrap(_E4M3)


_E4M3 = _e4m3  # the plain function, kept apart from the name _kernel rebinds


def can_run(device: torch.device) -> bool:
    """Whether the Triton kernel runs on `device`: CUDA, or the CPU under TRITON_INTERPRET=1 (tests)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    interpreting = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    return device.type == "cuda" or (device.type == "cpu" and interpreting)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) @ W^T (+ bias) -> [M, N] in x's dtype, W read as FP8 in the kernel."""
    if x.shape[-1] != w.K:
        raise ValueError(f"x has {x.shape[-1]} columns but the FP8 weight has K = {w.K}")
    x = x.contiguous()
    weight, scale = w.weight.contiguous().view(torch.uint8), w.scale.float().contiguous()
    out = torch.empty(x.shape[0], w.N, device=x.device, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    interp = x.device.type == "cpu"
    block_m = 16 if x.shape[0] <= 16 else 64
    grid = (-(-x.shape[0] // block_m), -(-w.N // 64))
    _kernel(interp)[grid](
        x, weight, scale, bias if bias is not None else x, out, x.shape[0], w.N, w.K,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        BLOCK_ROWS=w.block[0], BLOCK_COLS=w.block[1], HAS_BIAS=bias is not None,
        F32_DOT=interp and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interp else "tf32",
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4,
    )  # fmt: skip
    return out
