"""The fp32 dequantize-then-matmul oracle that every W4A16 kernel is tested against (STYLE principle 6)."""

from __future__ import annotations

import torch

from .marlin import MarlinWeight, from_marlin


def dequantize_marlin(mw: MarlinWeight) -> torch.Tensor:
    """fp32 [K, N] weight in natural input-row order, so that `x @ W` is the layer (no activation perm needed).

    Goes through `from_marlin` (the exact inverse of the repack) and `QuantizedWeight.dequantize`, i.e. through
    code that shares no index maths with the kernels: `W[i, o] = scale[g(i), o] * (q[i, o] - zero[g(i), o])`.
    """
    return from_marlin(mw).dequantize(torch.float32)


def w4a16_reference(x: torch.Tensor, mw: MarlinWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `x @ W (+ bias)` for x [..., K]; returns fp32 [..., N].

    The inputs are used as given (an fp16 x is widened exactly), so a kernel fed the same fp16 x is compared on
    the same numbers: the only differences left are the kernel's own roundings.
    """
    if x.shape[-1] != mw.K:
        raise ValueError(f"w4a16_reference: x has {x.shape[-1]} input features, the weight has K={mw.K}")
    out = x.float() @ dequantize_marlin(mw).to(x.device)
    return out if bias is None else out + bias.float()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """mean|C - C_ref| / mean|C_ref|, the acceptance metric of STYLE principle 6 (a kernel passes below 1e-3)."""
    ref = ref.float()
    return float((out.float() - ref).abs().mean() / ref.abs().mean().clamp_min(1e-30))
