"""What the torch backend runs, readable without importing torch: the backend's plan reads it to choose, the model
and the weight loader to build.

The architectures are the registry's (quantserve.gguf.archs, ArchSpec.torch): one entry serves conversion and this
backend. A LLaVA is its language model's family behind a CLIP tower (llava.py). LOAD_QUANTS are the --quant values
applied at load (RTN W4A16, weights.py)."""

from quantserve.gguf.archs import torch_architectures

MULTIMODAL = ("LlavaForConditionalGeneration",)
LOAD_QUANTS = ("int4",)


def runs(architecture: str | None) -> bool:
    """Whether the torch backend runs a checkpoint whose config.json names `architecture` first."""
    return architecture in torch_architectures() or architecture in MULTIMODAL
