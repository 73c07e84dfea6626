"""AWQ GEMM writer: qweight/qzeros packed along N with AutoAWQ's interleave, raw zeros.

Section names refer to docs/quantized-checkpoints.md ("AWQ GEMM layout").
"""

from __future__ import annotations

from typing import Any

import torch

from quantserve.converters.hf_quant.writer import LayerEncoder
from quantserve.errors import ConfigError
from quantserve.formats.quant_tensors import AWQ_ORDER
from quantserve.kernels.packing import pack
from quantserve.kernels.qweight import QuantizedWeight


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] -> int32 [R, N/8]: slot p of word c holds column 8c + AWQ_ORDER[p]."""
    r = values.shape[0]
    return pack(values.reshape(r, -1, 8)[:, :, list(AWQ_ORDER)].reshape(r, -1), 4, dim=1)


class AWQEncoder(LayerEncoder):
    """AWQ is 4-bit, asymmetric and without act-order. Symmetric weights are written with zero 8 everywhere,
    which is the same dequantization (lossless); anything else is refused with the format to use instead."""

    fmt = "awq"

    uniform_sym = False

    def encode(
        self, prefix: str, w: QuantizedWeight, bias: torch.Tensor | None
    ) -> list[tuple[str, torch.Tensor]]:
        w = w.with_trivial_g_idx_dropped()
        why = None
        if w.bits != 4:
            why = f"is {w.bits}-bit (AWQ is 4-bit only)"
        elif w.g_idx is not None:
            why = "uses act-order (a non-trivial g_idx), which AWQ cannot store"
        elif w.group_size == -1 or w.K % w.group_size:
            why = f"has group_size {w.group_size} over K={w.K} (AWQ needs a positive group size dividing K)"
        elif w.N % 8:
            why = f"has N={w.N}, not a multiple of 8"
        if why:
            raise ConfigError(f"AWQ: '{prefix}' {why}; write it as gptq or compressed-tensors instead")
        self.check_uniform(prefix, w)
        scales = self.scales(prefix, w.scales, torch.float16)
        out = [
            (f"{prefix}.qweight", awq_pack(w.qweight)),
            (f"{prefix}.qzeros", awq_pack(w.zero_points())),
            (f"{prefix}.scales", scales),
        ]
        if bias is not None:
            out.append((f"{prefix}.bias", bias.to(scales.dtype)))
        return out

    def quantization_config(self, left_dense: list[str]) -> dict[str, Any]:
        assert self.first is not None
        # transformers' key names, as AutoAWQ writes them ("AWQ configuration"); vLLM also accepts
        # w_bit/q_group_size
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": self.first[2],
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": left_dense or None,
        }
