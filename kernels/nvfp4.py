"""NVFP4 weights (NVIDIA's FP4, as compressed-tensors writes llm-compressor's NVFP4A16): 4-bit e2m1 values, 16 to a
block that shares an FP8 e4m3 scale, and one fp32 global scale per tensor. Read as they ship, never expanded at load.

Layout (compressed-tensors' `nvfp4-pack-quantized`), for a weight W [N, K]:
- `packed` uint8 [N, K / 2]: byte j holds element 2j in its low nibble and 2j + 1 in its high one (as MXFP4);
- `scales` float8_e4m3fn [N, K / 16];
- `global_scale` float32 [1]: W[n, k] = e2m1(n, k) * scales[n, k // 16] / global_scale.
The e2m1 values are mxfp4.py's; the product with scale / global_scale is computed in fp32 (compressed-tensors
decompresses in bf16, which rounds it once more).

`nvfp4_linear_ref` dequantizes then multiplies (the CPU path and the tests' reference); `nvfp4_linear` is a Triton
GEMM that decodes nibbles and scales in registers, reusing mxfp4.py's e2m1 decoder and fp8.py's e4m3 one, so it needs
no FP4 or FP8 hardware. Like them it calls only Triton builtins and is wrapped at first use, keyed by the interpreter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from . import fp8, mxfp4

tl: Any = None  # triton.language, bound on first use: importing this module never imports triton

BLOCK = 16  # values per scale


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype=torch.float32):
    """W [N, K] in `dtype` (computed in fp32) from packed [N, K/2], scales [N, K/16] and the global scale."""
    lut = torch.tensor(mxfp4.FP4_VALUES, dtype=torch.float32, device=packed.device)
    vals = torch.stack((lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]), dim=-1).flatten(-2)
    n, k = vals.shape
    scale = scales.float() / global_scale.float().reshape(())
    return (vals.view(n, k // BLOCK, BLOCK) * scale[..., None]).view(n, k).to(dtype)


@dataclass(frozen=True)
class Nvfp4Weight:
    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor

    bits = 4

    @property
    def N(self) -> int:  # noqa: N802 - GEMM letters
        return self.packed.shape[0]

    @property
    def K(self) -> int:  # noqa: N802
        return self.packed.shape[1] * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[K, N], the orientation QuantizedWeight.dequantize returns."""
        return dequantize(self.packed, self.scales, self.global_scale, dtype).t()


def nvfp4_linear_ref(x: torch.Tensor, w: Nvfp4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x @ dequantize(w.packed, w.scales, w.global_scale, x.dtype).T
    return out if bias is None else out + bias.to(x.dtype)


def _nvfp4_gemm(
    x_ptr, p_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, inv_global,
    stride_xm, stride_pn, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for one tile; as mxfp4.py's GEMM, the activations split into
    even and odd columns to meet each byte's low and high nibbles; scales are e4m3 bytes, one per 16 columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_K // 2)
    m_mask = m < M
    n_mask = n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + 2 * j
        k_mask = kk < K
        xmask = m_mask[:, None] & k_mask[None, :]
        xe = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0)
        xo = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :] + 1, mask=xmask, other=0.0)
        wmask = k_mask[:, None] & n_mask[None, :]
        byte = tl.load(p_ptr + n[None, :] * stride_pn + (k0 // 2 + j)[:, None], mask=wmask, other=0)
        sc = tl.load(s_ptr + n[None, :] * stride_sn + (kk // 16)[:, None], mask=wmask, other=0)
        scale = _e4m3(sc) * inv_global
        acc += tl.dot(_act(xe, F32_DOT), _weight(byte & 0x0F, scale, xe, F32_DOT), input_precision=DOT_PRECISION,
                      out_dtype=tl.float32)  # fmt: skip
        acc += tl.dot(_act(xo, F32_DOT), _weight(byte >> 4, scale, xo, F32_DOT), input_precision=DOT_PRECISION,
                      out_dtype=tl.float32)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


# the helpers the kernel calls, by name: e2m1 values (mxfp4.py), e4m3 bytes (fp8.py), the activations' dtype; the
# plain functions, which _kernel binds to those names as wrappers of the kernel's own kind
_HELPERS = {"_weight": mxfp4._HELPERS["_weight"], "_act": mxfp4._HELPERS["_act"], "_e4m3": fp8._E4M3}
_weight, _act, _e4m3 = _HELPERS["_weight"], _HELPERS["_act"], _HELPERS["_e4m3"]


def _kernel(interpret: bool) -> Any:
    kernel, helpers = _wrapped(interpret)
    globals().update(helpers)
    return kernel


@functools.cache
def _wrapped(interpret: bool) -> tuple[Any, dict[str, Any]]:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    mxfp4.tl = fp8.tl = tl  # the helpers read `tl` from their own modules
    wrap = InterpretedFunction if interpret else JITFunction
    return wrap(_nvfp4_gemm), {name: wrap(fn) for name, fn in _HELPERS.items()}


def nvfp4_linear(
    x: torch.Tensor, w: Nvfp4Weight, bias: torch.Tensor | None = None, inv_global: float | None = None
) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) @ W^T (+ bias) -> [M, N] in x's dtype, W read as NVFP4 in the kernel.
    `inv_global`: 1 / w.global_scale, read once by the caller: reading it here from a GPU tensor would stop the
    host on every call, and a CUDA graph cannot capture that."""
    if x.shape[-1] != w.K or w.K % BLOCK:
        raise ValueError(
            f"x has {x.shape[-1]} columns for the NVFP4 weight's K = {w.K} (a multiple of {BLOCK})"
        )
    x, packed = x.contiguous(), w.packed.contiguous()
    scales = w.scales.contiguous().view(torch.uint8)
    out = torch.empty(x.shape[0], w.N, device=x.device, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    interp = x.device.type == "cpu"
    block_m = 16 if x.shape[0] <= 16 else 64
    grid = (-(-x.shape[0] // block_m), -(-w.N // 64))
    _kernel(interp)[grid](
        x, packed, scales, bias if bias is not None else x, out, x.shape[0], w.N, w.K,
        inv_global if inv_global is not None else 1.0 / float(w.global_scale.reshape(-1)[0]),
        x.stride(0), packed.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, F32_DOT=interp and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interp else "tf32",
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4,
    )  # fmt: skip
    return out
