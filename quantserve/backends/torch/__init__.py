"""The torch backend: our own Llama-family model, W4A16 kernels, paged KV cache."""
