"""Fp8Linear: an nn.Linear stand-in whose weight stays FP8 (e4m3) in memory, one byte a weight plus its scales.

Each call decodes the weight to the activations' dtype and multiplies (W8A16): exact in fp32, one rounding in
bf16/fp16, on any device. This is the portable path; it moves the decoded matrix through memory, so on a GPU it is
correct but not yet fast (docs/quantized-checkpoints.md, "FP8"). The checkpoint's activation scheme (dynamic or
static FP8 activations) is not applied: activations stay in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from quantserve.kernels.fp8 import Fp8Weight


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

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] decoded to `dtype` (computed in fp32)."""
        return Fp8Weight(self.weight, self.scale, self.block).dense(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, block={self.block}"
        )
