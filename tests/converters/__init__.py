"""Tests of converters/ (quantserve.converters): quantizers, recipes, quantized conversion, cache, eval."""
