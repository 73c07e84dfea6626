"""Which backend serves a model, and its plan: the one asked for, or `auto` from the weights' format and the
hardware. BACKENDS lists every backend; each is an object with plan() and load() (quantserve.core.plan)."""

from __future__ import annotations

import logging

from quantserve.backends.llamacpp.backend import LlamaCppBackend
from quantserve.backends.torch.archs import LOAD_QUANTS, runs
from quantserve.backends.torch.backend import TorchBackend
from quantserve.core.plan import ModelPlan
from quantserve.core.settings import EngineSettings
from quantserve.errors import BackendUnavailableError
from quantserve.formats import ModelSpec
from quantserve.gguf.params import conversion_refusal

log = logging.getLogger("quantserve")

# Neither module imports llama.cpp or torch until a plan or a load needs it.
BACKENDS = {"llamacpp": LlamaCppBackend(), "torch": TorchBackend()}


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
    if not runs(arch):
        return "llamacpp", f"the torch backend does not implement {arch or 'this architecture'}"
    if (why := conversion_refusal(spec.config or {})) is not None:
        return "torch", f"llama.cpp cannot be given this checkpoint ({why}); the torch backend runs it"
    if quant and quant.lower() in LOAD_QUANTS:
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


def plan_model(spec: ModelSpec, settings: EngineSettings) -> ModelPlan:
    """The plan for `spec` under `settings` (a models.toml entry's defaults already in them): the backend's
    choice, then that backend's plan. Headers only.

    Raises:
        QuantserveError: an unknown backend; a format or a setting the chosen backend refuses; malformed files.
    """
    name, reason = choose_backend(spec, settings.backend, settings.quant)
    return BACKENDS[name].plan(spec, settings, reason)
