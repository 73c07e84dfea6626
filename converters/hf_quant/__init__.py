"""Quantized HF checkpoints written in the layouts GPTQ, AWQ, compressed-tensors and Marlin loaders read.

writer.py holds the shared part (sharded safetensors, config.json, tokenizer files, staging); each other
module is one format's `LayerEncoder`.
"""

from __future__ import annotations

from quantserve.converters.hf_quant.writer import WriteOptions, write_quantized, writers

__all__ = ["WriteOptions", "write_quantized", "writers"]
