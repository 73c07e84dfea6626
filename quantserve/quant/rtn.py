"""Round-to-nearest group quantization with GPTQ's quantizer maths, and the group helper GPTQ reuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantserve.errors import ConfigError
from quantserve.kernels.qweight import QuantizedWeight

SUPPORTED_BITS = (2, 3, 4, 8)


def check_quant_args(k: int, bits: int, group_size: int, name: str = "weight") -> int:
    """The group length in columns (K for group_size -1) after checking the arguments against K.

    Raises:
        ConfigError: unsupported bits, a non-positive group size, or K not a multiple of group_size (never
            mis-group silently: every reader assumes full groups).
    """
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"{bits}-bit quantization is not supported; use --bits 2, 3, 4 or 8")
    if group_size == -1:
        return k
    if group_size <= 0:
        raise ConfigError(f"group_size must be positive or -1; got {group_size}")
    if k % group_size:
        fits = [g for g in (128, 64, 32) if g < group_size and k % g == 0]
        hint = f"--group-size {fits[0]} (divides {k}) or -1" if fits else "--group-size -1"
        raise ConfigError(f"{name}: K={k} is not a multiple of group_size {group_size}; use {hint}")
    return group_size


@dataclass(frozen=True)
class GroupQuantizer:
    """Uniform per-group, per-output-channel quantizer of GPTQ (docs/quantized-checkpoints.md,
    "GPTQ quantizer"; AutoGPTQ quantizer.py).

    Scales are rounded to `scale_dtype` *before* the weights are quantized, so that `scale * (q - zero)` here
    is bit-for-bit what `QuantizedWeight.dequantize()` computes from the stored scales (GPTQ feeds the error
    of exactly those values forward).
    """

    bits: int
    sym: bool
    scale_dtype: torch.dtype = torch.float16

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def find_params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w [..., G] float32 -> (scale, zero), each [..., 1] float32; zero holds integers in [0, maxq]."""
        # The range always includes 0, so that 0 is exactly representable (a zero weight stays zero).
        xmin = w.amin(-1, keepdim=True).clamp(max=0)
        xmax = w.amax(-1, keepdim=True).clamp(min=0)
        if self.sym:
            # "GPTQ quantizer": scale = 2·max(|xmin|, xmax)/maxq, also when xmin is 0 (the reference then uses
            # xmax/maxq with zero 2^(b-1), which clips the upper half of an all-positive group).
            xmax = torch.maximum(-xmin, xmax)
            xmax = torch.where(xmax == 0, torch.ones_like(xmax), xmax)  # all-zero group: any scale works
            scale = self.round_scale(2 * xmax / self.maxq)
            return scale, torch.full_like(scale, (self.maxq + 1) // 2)
        dead = (xmin == 0) & (xmax == 0)
        xmin = torch.where(dead, -torch.ones_like(xmin), xmin)
        xmax = torch.where(dead, torch.ones_like(xmax), xmax)
        scale = self.round_scale((xmax - xmin) / self.maxq)
        return scale, torch.round(-xmin / scale).clamp(0, self.maxq)

    def round_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """Round to the stored dtype and back; keep it finite and non-zero (fp16 underflows below 6e-8)."""
        info = torch.finfo(self.scale_dtype)
        tiniest = info.tiny * info.eps  # the smallest subnormal
        return scale.clamp(tiniest, info.max).to(self.scale_dtype).float().clamp(min=tiniest)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Unsigned integer values (as float32) q = clamp(round(w/scale) + zero, 0, maxq)."""
        return (torch.round(w / scale) + zero).clamp(0, self.maxq)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        # Same expression and order as QuantizedWeight.dequantize, so the results are bit-identical.
        return scale * (q - zero)


def quantize_groups(
    w: torch.Tensor, quantizer: GroupQuantizer, group_size: int, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorised round-to-nearest of w [N, K] in groups of `group_size` along K.

    Returns (q [N, K], scale [N, n_groups], zero [N, n_groups]), all float32 on w's device.
    """
    n, k = w.shape
    g = check_quant_args(k, quantizer.bits, group_size, name)
    wg = w.float().reshape(n, k // g, g)
    scale, zero = quantizer.find_params(wg)
    q = quantizer.quantize(wg, scale, zero)
    return q.reshape(n, k), scale[..., 0], zero[..., 0]


def fake_quantize(w: torch.Tensor, quantizer: GroupQuantizer, group_size: int) -> torch.Tensor:
    """Quantize then dequantize w [N, K] (float32 result), for searches that only need the rounding error."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    wg = w.float().reshape(n, k // g, g)
    scale, zero = quantizer.find_params(wg)
    return quantizer.dequantize(quantizer.quantize(wg, scale, zero), scale, zero).reshape(n, k)


def to_quantized_weight(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    quantizer: GroupQuantizer,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Pack [N, K] integer values and [N, n_groups] params (nn.Linear orientation) into the canonical
    QuantizedWeight, which is GEMM-oriented: qweight [K, N], scales/zeros [n_groups, N]."""
    zeros = None if quantizer.sym else zero.t().to(torch.uint8).contiguous()
    return QuantizedWeight(
        qweight=q.t().to(torch.uint8).contiguous(),
        scales=scale.t().to(quantizer.scale_dtype).contiguous(),
        zeros=zeros,
        bits=quantizer.bits,
        group_size=group_size,
        g_idx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
    )


def quantize_rtn(
    w: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    scale_dtype: torch.dtype = torch.float16,
    name: str = "weight",
) -> QuantizedWeight:
    """Round-to-nearest quantization of one linear's weight.

    Args:
        w: [N, K] (nn.Linear layout: out_features x in_features), any float dtype, any device.
        bits: 2, 3, 4 or 8.
        group_size: groups of this many input columns, or -1 for one group per output channel.
        sym: symmetric (zero fixed at 2^(bits-1), `zeros` None) or asymmetric (a zero point per group).
        scale_dtype: dtype of the stored scales (float16 like every GPTQ checkpoint).
        name: the tensor's name, for error messages.

    Returns:
        QuantizedWeight in GEMM orientation ([K, N]), on w's device.

    Raises:
        ConfigError: bad bits/group_size, or K not a multiple of group_size.
    """
    quantizer = GroupQuantizer(bits, sym, scale_dtype)
    q, scale, zero = quantize_groups(w, quantizer, group_size, name)
    return to_quantized_weight(q, scale, zero, quantizer, group_size)
