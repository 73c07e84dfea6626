"""Tests of quantserve.backends.llamacpp: runner, probe, GPU offload, RPC, vision, rerank, selection."""
