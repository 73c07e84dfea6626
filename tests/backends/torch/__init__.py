"""Tests of quantserve.backends.torch: engine, model families, CUDA graphs, tensor parallel, CUDA, vision."""
