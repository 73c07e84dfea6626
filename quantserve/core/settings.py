"""EngineSettings: how a model is run, built once (from CLI flags, models.toml, or `quantserve.load` keywords)
and handed down unchanged: the engine reads the common fields, each backend its own section as well."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from quantserve.errors import ConfigError
from quantserve.registry import parse_gpu_layers

MAX_DEFAULT_CTX = 8192  # a model's full training context is rarely what a user wants, nor what memory allows


@dataclass(frozen=True)
class LlamaCppSettings:
    """What only the llama.cpp backend reads."""

    kv_unified: bool = False  # one KV pool of kv_size cells shared by all sequences, not ctx_size cells each
    # windowed layers keep every position (llama.cpp's default), not only their window's (llama-server's)
    swa_full: bool = False
    n_gpu_layers: int | None = (
        None  # None: auto (as many as fit the GPU, backends/llamacpp/offload.py); -1: all
    )
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"  # auto (llama.cpp decides), on, off
    use_mmap: bool = True
    mmproj: str | None = None  # a LLaVA GGUF's vision projector (None: an mmproj GGUF found beside the model)
    probe: bool = False  # load and run each GGUF in a child process first, so a C abort cannot kill this one
    rpc: str | None = None  # llama.cpp RPC workers, host:port[,host:port...], whose devices take layers
    tensor_split: str | None = (
        None  # share of the offloaded model per device, e.g. "3,1" (None: by free memory)
    )
    split_mode: str = (
        "layer"  # layer (whole layers per device), row (each matrix across GPUs), none (main_gpu)
    )
    main_gpu: int = 0  # the device for the whole model with split_mode none, and for row mode's small tensors


@dataclass(frozen=True)
class TorchSettings:
    """What only the torch backend reads."""

    block_size: int = 16  # tokens per KV block (the unit of paging and of prefix caching)
    tensor_parallel_size: int = 1  # ranks the model is split over (backends/torch/tp.py)
    gpu_memory_utilization: float = (
        0.90  # share of the GPU's memory the model, KV cache and activations may use
    )
    # size the KV cache to fill gpu_memory_utilization of the GPU (vLLM's way); off (router mode, where several
    # models share the GPU): room for max_num_seqs sequences at full context, as on the CPU
    kv_fill_gpu: bool = True
    cuda_graphs: bool = (
        True  # replay decode steps as CUDA graphs (off: every step eager, vLLM's --enforce-eager)
    )


class ModelDefaults(Protocol):
    """What a models.toml entry may set for its model (quantserve.registry.ModelEntry)."""

    n_gpu_layers: int | str | None
    rpc: str | None
    tensor_parallel_size: int | None
    backend: str
    quant: str
    ctx_size: int
    chat_template: str | None
    reasoning: str | None
    reasoning_format: str | None
    reasoning_budget: int | None
    sampling: dict[str, Any]


@dataclass(frozen=True)
class EngineSettings:
    backend: str = "auto"  # auto, llamacpp or torch
    ctx_size: int = 0  # longest sequence, prompt + output; 0 = the model's, at most 8192
    kv_size: int = 0  # KV capacity in tokens; 0 = per backend (see the runners)
    prefix_cache: bool = True  # reuse the KV of a shared prompt prefix
    max_num_seqs: int = 4
    max_queue_len: int = 64
    n_batch: int = 512  # tokens per engine step
    threads: int = 0  # CPU threads; 0 = all cores
    seed: int | None = None  # for requests that give none
    chat_template: str | None = None  # a file overriding the model's template
    reasoning: str = "auto"  # thinking models: on, off, or auto (the template's default)
    reasoning_format: str = "auto"  # auto: reasoning apart from the answer; none: left in the content
    reasoning_budget: int | None = None  # most reasoning tokens per reply (None: unbounded)
    quant: str | None = None  # quantize a dense checkpoint at load (q4_k_m, int4, ...)
    use_cache: bool = True  # keep in-situ conversions in the cache, not in a temporary directory
    cache_dir: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    llamacpp: LlamaCppSettings = field(default_factory=LlamaCppSettings)
    torch: TorchSettings = field(default_factory=TorchSettings)

    @classmethod
    def from_options(cls, **options: Any) -> EngineSettings:
        """Flat options, as the CLI and `quantserve.load` take them, each put where its name belongs: a field of
        EngineSettings itself or of one backend's section.

        Raises:
            TypeError: a name no section has.
        """
        sections = {"llamacpp": LlamaCppSettings, "torch": TorchSettings}
        own = {f.name for f in fields(cls)}
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in options.items():
            if key == "n_gpu_layers":
                value = parse_gpu_layers(value)
            where = next((s for s, c in sections.items() if key in {f.name for f in fields(c)}), None)
            if where is not None:
                nested[where][key] = value
            elif key in own:
                top[key] = value
            else:
                raise TypeError(f"unknown engine setting {key!r}")
        for name, section in sections.items():
            if nested[name]:
                top[name] = replace(top.get(name, section()), **nested[name])
        return cls(**top)

    def n_ctx(self, n_ctx_train: int | None) -> int:
        """The context a sequence gets: --ctx-size, else the model's own capped at MAX_DEFAULT_CTX."""
        return self.ctx_size or min(n_ctx_train or MAX_DEFAULT_CTX, MAX_DEFAULT_CTX)

    def for_model(self, entry: ModelDefaults) -> EngineSettings:
        """These settings with the model's own defaults from models.toml filled in where none was given."""
        llamacpp = self.llamacpp
        if llamacpp.n_gpu_layers is None and entry.n_gpu_layers is not None:
            llamacpp = replace(llamacpp, n_gpu_layers=parse_gpu_layers(entry.n_gpu_layers))
        if llamacpp.rpc is None and entry.rpc:
            llamacpp = replace(llamacpp, rpc=entry.rpc)
        own = self.torch
        if own.tensor_parallel_size == 1 and entry.tensor_parallel_size:
            own = replace(own, tensor_parallel_size=entry.tensor_parallel_size)
        return replace(
            self,
            llamacpp=llamacpp,
            torch=own,
            backend=self.backend if self.backend != "auto" else entry.backend,
            ctx_size=self.ctx_size or entry.ctx_size,
            quant=self.quant or entry.quant or None,
            chat_template=self.chat_template or entry.chat_template,
            reasoning=entry.reasoning if self.reasoning == "auto" and entry.reasoning else self.reasoning,
            reasoning_format=(
                entry.reasoning_format
                if self.reasoning_format == "auto" and entry.reasoning_format
                else self.reasoning_format
            ),
            reasoning_budget=(
                self.reasoning_budget if self.reasoning_budget is not None else entry.reasoning_budget
            ),
            sampling_defaults={**entry.sampling, **self.sampling_defaults},
        )


def parse_tensor_split(text: str) -> list[float]:
    """--tensor-split "3,1": one non-negative share per device, at least one above zero (llama.cpp normalises).

    Raises:
        ConfigError: anything else, saying what is accepted.
    """
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        shares = []
    if not shares or any(not x >= 0 for x in shares) or not any(shares) or len(shares) > 16:
        raise ConfigError(
            f"--tensor-split {text!r}: give one share per device, comma-separated, e.g. 3,1 (at most 16; at least "
            "one above 0)",
            param="tensor_split",
        )
    return shares


def cpu_threads(threads: int) -> int:
    """The CPU threads to compute with: `threads`, or where it is 0 (all cores) QUANTSERVE_THREADS if that is set,
    as `quantserve run` reads it, so the library, `eval` and `convert --check` follow it too; else 0, the backend's
    own all-cores default."""
    if threads:
        return threads
    value = os.environ.get("QUANTSERVE_THREADS", "").strip()
    return int(value) if value.isdigit() else 0
