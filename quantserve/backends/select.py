"""Which backend serves a model: the one asked for, or `auto` from the weights' format and the hardware.

The choice and its reason are logged, so a user can see why a model runs where it runs.
"""

from __future__ import annotations

import importlib
import logging

from quantserve.core.runner import LoadedModel
from quantserve.core.settings import EngineSettings
from quantserve.errors import BackendUnavailableError, require_torch
from quantserve.formats import ModelSpec

log = logging.getLogger("quantserve")

# name -> "module:function" taking (spec, EngineSettings) and returning a LoadedModel.
# Imported on use: the llama.cpp path never pays for importing torch, and vice versa.
BACKENDS = {
    "llamacpp": "quantserve.backends.llamacpp.loader:load_llamacpp",
    "torch": "quantserve.backends.torch.loader:load_torch",
}
# What the torch backend can run, known here without importing torch (model.py and weights.py check the same).
TORCH_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlavaForConditionalGeneration",
)  # fmt: skip
TORCH_LOAD_QUANTS = ("int4",)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def choose_backend(spec: ModelSpec, requested: str, quant: str | None = None) -> tuple[str, str]:
    """(backend, reason). Raises BackendUnavailableError for an unknown name."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise BackendUnavailableError(
                f"unknown backend {requested!r}; choose one of auto, {', '.join(BACKENDS)}"
            )
        return requested, "asked for"
    if spec.format == "gguf":
        return "llamacpp", "GGUF is llama.cpp's own format"
    arch = next(iter((spec.config or {}).get("architectures") or []), None)
    if arch not in TORCH_ARCHITECTURES:
        return "llamacpp", f"the torch backend does not implement {arch or 'this architecture'}"
    if quant and quant.lower() in TORCH_LOAD_QUANTS:
        return "torch", f"--quant {quant} is applied at load by the torch backend"
    if quant:
        return "llamacpp", f"--quant {quant} is a GGUF type, which llama.cpp serves"
    if _cuda():
        what = (
            "fp16/bf16 weights" if spec.format == "safetensors" else f"{spec.format} weights (Marlin W4A16)"
        )
        return "torch", f"{what} and a CUDA GPU"
    if spec.format == "safetensors":
        return (
            "llamacpp",
            "no CUDA GPU: llama.cpp serves dense weights fastest on CPU, after conversion to GGUF",
        )
    return "llamacpp", (
        f"no CUDA GPU: llama.cpp serves {spec.format} weights faster on CPU than the torch backend's CPU path, "
        "after dequantization and conversion to GGUF (q8_0 unless --quant says otherwise)"
    )


def load_backend(spec: ModelSpec, settings: EngineSettings) -> LoadedModel:
    name, reason = choose_backend(spec, settings.backend, settings.quant)
    log.info("backend %s for %s: %s", name, spec.path, reason)
    if name == "torch":
        require_torch("the torch backend")
    module, func = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), func)(spec, settings)
