"""Tests of quantserve.formats and quantserve.registry: detection, header validation, quant layouts."""
