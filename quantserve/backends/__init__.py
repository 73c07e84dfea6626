"""Backends: each turns scheduled token batches into sampled tokens (llama.cpp, and our own torch model); the
contract they fulfil is quantserve.core.runner."""
