"""nn.Linear stand-ins whose weights stay in a float checkpoint's own bytes: Fp8Linear (FP8 e4m3, a byte a weight
plus its scales), Mxfp4Linear and Nvfp4Linear (e2m1, half a byte plus a scale per 32 or 16).

The activations stay in the model's dtype (a checkpoint's FP8 or FP4 activation quantization is not applied). On
CUDA a Triton GEMM (kernels/fp8.py, mxfp4.py, nvfp4.py) decodes the weight tile by tile in registers; elsewhere each
call decodes the whole weight to the activations' dtype and multiplies (exact in fp32, one rounding in bf16/fp16):
the portable path, slow but correct (docs/quantized-checkpoints.md, "FP8").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from quantserve.kernels import fp8, mxfp4, nvfp4
from quantserve.kernels.fp8 import Fp8Weight
from quantserve.kernels.mxfp4 import Mxfp4Weight
from quantserve.kernels.nvfp4 import Nvfp4Weight


class Fp8Linear(nn.Module):
    def __init__(self, w: Fp8Weight, bias: torch.Tensor | None, *, dtype: torch.dtype, device: torch.device,
                 name: str):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = w.K, w.N
        self.block = w.block
        self.name = name
        self.register_buffer("weight", w.weight.to(device), persistent=False)
        self.register_buffer("scale", w.scale.to(device, torch.float32), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        # the Triton GEMM on CUDA (or on the CPU under TRITON_INTERPRET=1, in tests)
        self.use_kernel = fp8.can_run(torch.device(device))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] decoded to `dtype` (computed in fp32)."""
        return Fp8Weight(self.weight, self.scale, self.block).dense(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            w = Fp8Weight(self.weight, self.scale, self.block)
            return fp8.fp8_linear(x.reshape(-1, self.in_features), w, self.bias).reshape(*x.shape[:-1], -1)
        return F.linear(x, self.dense(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, block={self.block}"
        )


class Mxfp4Linear(nn.Module):
    """An nn.Linear stand-in whose weight stays MXFP4 (4.25 bits a weight): kernels/mxfp4.py's Triton GEMM on CUDA
    (the one gpt-oss's experts run), elsewhere the weight decoded to the activations' dtype first (exact in fp32
    and bf16)."""

    def __init__(self, w: Mxfp4Weight, bias: torch.Tensor | None, *, dtype: torch.dtype, device: torch.device,
                 name: str):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = w.K, w.N
        self.name = name
        self.register_buffer("blocks", w.blocks.to(device), persistent=False)
        self.register_buffer("scales", w.scales.to(device), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        self.use_kernel = mxfp4.can_run(torch.device(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.use_kernel:
            out = mxfp4.mxfp4_linear(flat, self.blocks, self.scales, self.bias)
        else:
            out = mxfp4.mxfp4_linear_ref(flat, self.blocks, self.scales, self.bias)
        return out.reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4"


class Nvfp4Linear(nn.Module):
    """An nn.Linear stand-in whose weight stays NVFP4 (4.5 bits a weight): kernels/nvfp4.py's Triton GEMM on CUDA,
    elsewhere the weight decoded to the activations' dtype first."""

    def __init__(self, w: Nvfp4Weight, bias: torch.Tensor | None, *, dtype: torch.dtype, device: torch.device,
                 name: str):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = w.K, w.N
        self.name = name
        self.register_buffer("packed", w.packed.to(device), persistent=False)
        self.register_buffer("scales", w.scales.to(device), persistent=False)
        self.register_buffer("global_scale", w.global_scale.to(device, torch.float32), persistent=False)
        self.inv_global = 1.0 / float(w.global_scale.reshape(-1)[0])  # read once, on the host (CUDA graphs)
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        self.use_kernel = mxfp4.can_run(torch.device(device))  # the same rule: CUDA, or the interpreter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        w = Nvfp4Weight(self.packed, self.scales, self.global_scale)
        out = (
            nvfp4.nvfp4_linear(flat, w, self.bias, self.inv_global)
            if self.use_kernel
            else nvfp4.nvfp4_linear_ref(flat, w, self.bias)
        )
        return out.reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4"
