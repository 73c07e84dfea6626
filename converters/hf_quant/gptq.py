"""GPTQ writer: qweight/qzeros/scales/g_idx as AutoGPTQ, GPTQModel, transformers and vLLM expect.

Section names refer to docs/quantized-checkpoints.md ("GPTQ").
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from quantserve.converters.hf_quant.writer import LayerEncoder, WriteOptions
from quantserve.errors import ConfigError
from quantserve.formats.quant_tensors import v1_zero_words
from quantserve.kernels.packing import pack
from quantserve.kernels.qweight import QuantizedWeight

logger = logging.getLogger(__name__)


def check_packable(prefix: str, w: QuantizedWeight, fmt: str) -> None:
    """GPTQ-style readers derive K and N from whole words: K*bits and N*bits must fill them exactly."""
    if (w.K * w.bits) % 32 or (w.N * w.bits) % 32:
        raise ConfigError(
            f"{fmt} packs {32 // w.bits if 32 % w.bits == 0 else '32 bits of'} values per int32 word, but "
            f"'{prefix}' has K={w.K}, N={w.N} at {w.bits} bits (K*bits and N*bits must be multiples of 32); "
            "leave this layer dense or pad it"
        )


def dense_rules(left_dense: list[str]) -> dict[str, dict[str, Any]]:
    """GPTQModel `dynamic` rules that keep these modules dense ("-:" skips, first match wins; vLLM honours it)."""
    return {f"-:{re.escape(p)}$": {} for p in left_dense}


def module_rules(overrides: dict[str, tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """GPTQModel `dynamic` rules giving these modules their own bits and group size (a mixed-precision model;
    "+:" applies the overrides, first match wins; vLLM's GPTQ and GPTQ-Marlin read them)."""
    return {
        f"+:^{re.escape(p)}$": {"bits": bits, "group_size": group}
        for p, (bits, group) in sorted(overrides.items())
    }


class GPTQEncoder(LayerEncoder):
    """v1 for symmetric weights (every consumer reads it), gptq_v2 for asymmetric ones unless v1 is requested:
    v1's zeros-minus-one wraps for a zero of 0 ("GPTQ zero points"). v1 zeros are written with GPTQModel's
    whole-word subtraction, which the reader's whole-word addition undoes exactly; for symmetric zeros it is
    per slot. Modules of other bits or group sizes than the first get `dynamic` rules."""

    fmt = "gptq"

    per_module = True

    def __init__(self, options: WriteOptions):
        super().__init__(options)
        if options.checkpoint_format not in (None, "gptq", "gptq_v2"):
            raise ConfigError(
                f"GPTQ checkpoint_format must be 'gptq' (v1) or 'gptq_v2', not {options.checkpoint_format!r}"
            )
        self.ckpt = options.checkpoint_format

    def encode(
        self, prefix: str, w: QuantizedWeight, bias: torch.Tensor | None
    ) -> list[tuple[str, torch.Tensor]]:
        self.check_uniform(prefix, w)
        check_packable(prefix, w, "GPTQ")
        if self.ckpt is None:
            self.ckpt = "gptq" if w.symmetric else "gptq_v2"
        elif self.ckpt == "gptq" and not w.symmetric and self.first and self.first[0] == prefix:
            logger.warning(
                "writing asymmetric GPTQ as v1 on request; readers adding 1 per slot misread ~13%% of zeros"
            )
        qzeros = pack(w.zero_points(), w.bits, dim=1)
        if self.ckpt == "gptq":
            qzeros = v1_zero_words(qzeros, w.bits, -1)
        scales = self.scales(prefix, w.scales, torch.float16)
        out = [
            (f"{prefix}.qweight", pack(w.qweight, w.bits, dim=0)),
            (f"{prefix}.qzeros", qzeros),
            (f"{prefix}.scales", scales),
            # AutoGPTQ writes g_idx even without act-order (the trivial i // G); vLLM's loaders expect it
            # ("GPTQ tensors")
            (f"{prefix}.g_idx", w.groups().to(torch.int32)),
        ]
        if bias is not None:
            out.append((f"{prefix}.bias", bias.to(scales.dtype)))
        return out

    def quantization_config(self, left_dense: list[str]) -> dict[str, Any]:
        assert self.first is not None
        sym = self.first[3]
        (bits, group), overrides = self.base_and_overrides()
        opts = self.options
        qc: dict[str, Any] = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "desc_act": self.act_order,
            "sym": sym,
            "checkpoint_format": self.ckpt,
            "lm_head": False,
            "static_groups": opts.static_groups,
        }
        if opts.damp_percent is not None:
            qc["damp_percent"] = opts.damp_percent
        if opts.true_sequential is not None:
            qc["true_sequential"] = opts.true_sequential
        if left_dense or overrides:
            qc["dynamic"] = dense_rules(left_dense) | module_rules(overrides)
        if opts.quantizer:
            qc["meta"] = {"quantizer": [opts.quantizer]}
        return qc

    def extra_json(self, qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
        # older AutoGPTQ and vLLM's --quantization path read quantize_config.json
        # ("GPTQ files and configuration", "Detection pitfalls")
        return {"quantize_config.json": qc}
