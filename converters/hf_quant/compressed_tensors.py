"""compressed-tensors pack-quantized writer (llm-compressor's W4A16 layout, read by vLLM).

Section names refer to docs/quantized-checkpoints.md ("compressed-tensors").
"""

from __future__ import annotations

import re
from typing import Any

import torch

from quantserve.converters.hf_quant.writer import LayerEncoder, WriteOptions
from quantserve.errors import ConfigError
from quantserve.formats.quant_tensors import pack_words
from quantserve.kernels.packing import pack
from quantserve.kernels.qweight import QuantizedWeight


class CTEncoder(LayerEncoder):
    """weight_packed [N, K*b/32] is the GPTQ qweight transposed, weight_scale [N, groups] the scales transposed,
    weight_zero_point [N*b/32, groups] the unsigned zeros packed along N (asymmetric only), weight_g_idx with
    actorder "group" ("compressed-tensors tensors", "compressed-tensors and GPTQ"). Stored values are
    signed + 2^(b-1), i.e. exactly the unsigned values."""

    fmt = "compressed-tensors"

    def __init__(self, options: WriteOptions):
        super().__init__(options)
        m = re.match(r"(\d+)\.(\d+)", options.ct_version)
        if not m:
            raise ConfigError(f"compressed-tensors version {options.ct_version!r} is not like '0.12.2'")
        # compressed-tensors < 0.18 packs 32 // b values per word; >= 0.18 a dense bitstream (differs for 3-bit)
        self.word_packing = (int(m[1]), int(m[2])) < (0, 18)
        self.with_g_idx = options.act_order

    def _pack(self, values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
        return pack_words(values, bits, dim) if self.word_packing and 32 % bits else pack(values, bits, dim)

    def encode(
        self, prefix: str, w: QuantizedWeight, bias: torch.Tensor | None
    ) -> list[tuple[str, torch.Tensor]]:
        w = w.with_trivial_g_idx_dropped()
        self.check_uniform(prefix, w)
        if self.with_g_idx is None:
            self.with_g_idx = w.g_idx is not None
        elif w.g_idx is not None and not self.with_g_idx:
            raise ConfigError(
                f"compressed-tensors states actorder once per scheme: '{prefix}' has act-order but the first "
                "layer had none; pass WriteOptions(act_order=True)"
            )
        s = w.scales
        scales = self.scales(
            prefix, s.t(), s.dtype if s.dtype in (torch.float16, torch.bfloat16) else torch.float16
        )
        out = [
            (f"{prefix}.weight_packed", self._pack(w.qweight.t(), w.bits, 1)),
            (f"{prefix}.weight_scale", scales),
            (f"{prefix}.weight_shape", torch.tensor([w.N, w.K], dtype=torch.int64)),
        ]
        if w.zeros is not None:
            out.append((f"{prefix}.weight_zero_point", self._pack(w.zeros.t(), w.bits, 0)))
        if self.with_g_idx:
            out.append((f"{prefix}.weight_g_idx", w.groups().to(torch.int32)))
        if bias is not None:
            out.append((f"{prefix}.bias", bias.to(scales.dtype)))
        return out

    def quantization_config(self, left_dense: list[str]) -> dict[str, Any]:
        assert self.first is not None
        _, bits, group, sym = self.first
        weights = {
            "num_bits": bits,
            "type": "int",
            "symmetric": sym,
            "strategy": "channel" if group == -1 else "group",
            "group_size": None if group == -1 else group,
            "actorder": "group" if self.with_g_idx else None,
            "dynamic": False,
            "block_structure": None,
            "observer": "minmax",
            "observer_kwargs": {},
        }
        scheme = {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": None,
            "output_activations": None,
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": scheme},
            "ignore": sorted({"lm_head", *left_dense}),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "version": self.options.ct_version,
        }
