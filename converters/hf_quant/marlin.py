"""Marlin writer: per-layer tensors in vLLM's gptq_marlin layout, named as AutoGPTQ's Marlin serialization.

Names: `B` (marlin_repack output), `s` (permuted scales), `bias` (natural order), and beyond AutoGPTQ's plain
4-bit symmetric case: `g_idx` (sorted) + `perm` (argsort of the original g_idx) for act-order, `zp`
(marlin_zero_points layout) for asymmetric 4-bit. For plain 4-bit symmetric G in {128, -1} the directory is
what AutoGPTQ and candle-vllm read (docs/marlin.md, "Serialized Marlin checkpoints").
"""

from __future__ import annotations

from typing import Any

import torch

from quantserve.converters.hf_quant.gptq import dense_rules
from quantserve.converters.hf_quant.writer import LayerEncoder
from quantserve.errors import ConfigError
from quantserve.formats.schemes.marlin import MARLIN_GROUPS
from quantserve.kernels.marlin import to_marlin
from quantserve.kernels.qweight import QuantizedWeight, QuantLayoutError


class MarlinEncoder(LayerEncoder):
    fmt = "marlin"

    def encode(
        self, prefix: str, w: QuantizedWeight, bias: torch.Tensor | None
    ) -> list[tuple[str, torch.Tensor]]:
        w = w.with_trivial_g_idx_dropped()  # a trivial g_idx would cost a runtime activation permutation
        self.check_uniform(prefix, w)
        if w.group_size not in MARLIN_GROUPS:
            raise ConfigError(
                f"Marlin: '{prefix}' has group_size {w.group_size}; the Marlin kernel supports {MARLIN_GROUPS}. "
                "Re-quantize with --group-size 128 or write gptq"
            )
        try:
            m = to_marlin(w, prefix)
        except QuantLayoutError as e:
            raise ConfigError(f"Marlin: {e}; write this model as gptq instead") from None
        out = [(f"{prefix}.B", m.qweight), (f"{prefix}.s", self.scales(prefix, m.scales, torch.float16))]
        if m.perm is not None:
            assert m.g_idx is not None
            out += [(f"{prefix}.g_idx", m.g_idx), (f"{prefix}.perm", m.perm)]
        if m.zeros is not None:
            out.append((f"{prefix}.zp", m.zeros))
        if bias is not None:
            out.append((f"{prefix}.bias", bias.to(out[1][1].dtype)))
        return out

    def quantization_config(self, left_dense: list[str]) -> dict[str, Any]:
        assert self.first is not None
        _, bits, group, sym = self.first
        qc: dict[str, Any] = {
            "quant_method": "gptq",
            "checkpoint_format": "marlin",
            "bits": bits,
            "group_size": group,
            "sym": sym,
            "desc_act": self.act_order,
            "lm_head": False,
        }
        if left_dense:
            qc["dynamic"] = dense_rules(left_dense)
        return qc

    def extra_json(self, qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {"quantize_config.json": qc}
