"""QuantLinear: an nn.Linear stand-in whose weight is 4/8-bit in the Marlin layout, run by a W4A16 kernel.

vLLM's pattern: weights arrive in the checkpoint's layout, are repacked once after loading (`to_marlin`), and the
kernel chosen by `can_implement` prepares its per-layer state once; `forward` only calls it.
"""

from __future__ import annotations

import torch
from torch import nn

from quantserve.errors import ConfigError
from quantserve.kernels.dispatch import KernelUnavailableError, W4A16Linear, prepare_w4a16
from quantserve.kernels.marlin import MarlinWeight, to_marlin
from quantserve.kernels.qweight import QuantizedWeight, QuantLayoutError


class QuantLinear(nn.Module):
    def __init__(
        self,
        marlin: MarlinWeight,
        layer: W4A16Linear,
        bias: torch.Tensor | None,
        name: str,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.activation_dtype = dtype  # what the kernel was prepared for
        self.in_features, self.out_features = marlin.K, marlin.N
        self.bits, self.group_size = marlin.bits, marlin.group_size
        # kept until fuse_projections has run (the Triton K-packed state is a copy, the others alias or unpack it)
        self.marlin: MarlinWeight | None = marlin
        self.layer = layer
        self.name = name
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_quantized(
        cls,
        qw: QuantizedWeight,
        bias: torch.Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        name: str,
        kernel: str | None = None,
    ) -> QuantLinear:
        """Repack `qw` to Marlin on `device` and prepare a kernel for `dtype` activations.

        Raises:
            ConfigError: the layer's shape or bits fit no Marlin layout or kernel; the message says why.
        """
        qw = qw.with_trivial_g_idx_dropped()
        qw = QuantizedWeight(
            qw.qweight.to(device),
            qw.scales.to(device),  # kept as stored (fp16 usually): the kernels take any scale dtype
            None if qw.zeros is None else qw.zeros.to(device),
            qw.bits,
            qw.group_size,
            None if qw.g_idx is None else qw.g_idx.to(device),
        )
        try:
            marlin = to_marlin(qw, name)
        except QuantLayoutError as exc:
            raise ConfigError(f"{name}: {exc}; serve this model with --backend llamacpp instead") from exc
        return cls.from_marlin(marlin, bias, dtype=dtype, device=device, name=name, kernel=kernel)

    @classmethod
    def from_marlin(
        cls,
        marlin: MarlinWeight,
        bias: torch.Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        name: str,
        kernel: str | None = None,
    ) -> QuantLinear:
        """Prepare a kernel for a weight already in the Marlin layout on `device`. Raises ConfigError."""
        try:
            layer = prepare_w4a16(marlin, dtype, device, kernel)
        except (QuantLayoutError, KernelUnavailableError) as exc:
            raise ConfigError(f"{name}: {exc}; serve this model with --backend llamacpp instead") from exc
        b = None if bias is None else bias.to(device, dtype)
        return cls(marlin, layer, b, name, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]"""
        return self.layer(x, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, "
            f"kernel={self.layer.kernel.name}"
        )
