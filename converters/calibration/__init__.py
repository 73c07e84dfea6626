"""Calibrated quantization (GPTQ, AWQ) and RTN of a dense HF checkpoint, layer by layer, into the formats
converters/hf_quant writes; and repacking one quantized checkpoint into another format."""

from __future__ import annotations

from quantserve.converters.calibration.quantize import QuantizeReport, quantize_checkpoint, repack_checkpoint

__all__ = ["QuantizeReport", "quantize_checkpoint", "repack_checkpoint"]
