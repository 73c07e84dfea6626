"""Fp8Weight: FP8 (e4m3) weights of one linear with their scales, as FP8 checkpoints store them.

One form for the three scale granularities checkpoints use (docs/quantized-checkpoints.md, "FP8"): a scale per
block of `block = (bn, bk)` weights, where one block spanning the matrix is a per-tensor scale and `(1, K)` a
per-output-channel one. A grid that does not divide the matrix has partial blocks at its right and bottom edges
(`scale[n // bn, k // bk]`, as vLLM indexes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Weight:
    """`W[n, k] = weight[n, k] * scale[n // block[0], k // block[1]]`, in nn.Linear orientation.

    Attributes:
        weight: float8_e4m3fn [N, K].
        scale: float32 [ceil(N / block[0]), ceil(K / block[1])], what a checkpoint calls `weight_scale_inv`
            (native FP8) or `weight_scale` (compressed-tensors): it multiplies.
        block: (rows, columns) one scale covers.
        input_scale: the activations' static scale (W8A8 static checkpoints), or None.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    input_scale: torch.Tensor | None = None

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
