"""ModelPlan: everything quantserve decides about a model before it loads, in one place.

A backend's `plan()` makes it from headers and configs alone (no weights read; the llama.cpp path imports no torch),
and its `load()` carries it out. Every caller reads the same plan: `LLM.load`, the router's slots and memory
estimate, /v1/models, `quantserve inspect` and the pre-check of `quantserve run`. So a fact about a model (its
backend, template, context, KV cache, capabilities) is decided once, and what `inspect` prints is what `run` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantserve.core.settings import EngineSettings
from quantserve.formats import ModelSpec

# Everything a model can be asked to do, in the order /v1/models lists it.
CAPABILITIES = ("completion", "chat", "tools", "vision", "embeddings", "rerank", "reasoning")


@dataclass(frozen=True)
class TemplateSource:
    """A chat template's Jinja source, where it was found (a file, a GGUF key, or --chat-template), and the text
    of the model's BOS and EOS tokens as its files name them (what the template renders for bos_token and
    eos_token; "" where the files do not say)."""

    text: str
    origin: str
    bos_token: str = ""
    eos_token: str = ""


@dataclass(frozen=True)
class KVPlan:
    """The KV cache a backend will allocate."""

    n_ctx: int  # the longest sequence, prompt and output
    cells: (
        int | None
    )  # tokens the cache holds in all; None: what the GPU's free memory holds, measured at load
    bytes_per_cell: int  # K and V of one token over every layer, at the cache's types
    layout: str  # "paged" (the torch backend's blocks) or "slots" (llama.cpp's sequences)

    @property
    def bytes(self) -> int | None:
        return None if self.cells is None else self.cells * self.bytes_per_cell


@dataclass(frozen=True)
class ModelPlan:
    """How a model will be run, and why."""

    spec: ModelSpec  # the detected files
    settings: EngineSettings  # the settings it runs with, its models.toml entry's defaults filled in
    architecture: str
    backend: str  # a key of quantserve.backends.select.BACKENDS
    reason: str  # why that backend
    steps: tuple[str, ...]  # what load() does, in order, one line each
    kv: KVPlan | None  # None: the header does not say (a vision projector)
    weight_bytes: int  # the weights as they will sit in memory (after any load-time quantization)
    template: TemplateSource | None
    tool_format: (
        str | None
    )  # the template's tool-call format (quantserve.chat.formats); None without a template
    capabilities: tuple[str, ...]  # a subset of CAPABILITIES
    # how the template marks reasoning, in words (quantserve.chat.reasoning); None: it has none
    reasoning: str | None = None
    vision: str | None = None  # what the model sees images with, in words; None: text only
    mmproj: Path | None = None  # a GGUF model's vision projector
    rank_outputs: int = 0  # a reranker GGUF's classification head (GGUFInfo.rank_outputs)

    @property
    def n_ctx(self) -> int:
        return self.kv.n_ctx if self.kv is not None else 0

    @property
    def memory_bytes(self) -> int:
        """Weights plus the KV cache: the router's estimate. llama.cpp's compute buffers are left out."""
        return self.weight_bytes + ((self.kv.bytes or 0) if self.kv is not None else 0)

    def rows(self) -> list[tuple[str, list[str]]]:
        """The plan as `inspect` prints it and the load logs it: (key, lines)."""
        kv = "unknown"
        if self.kv is not None:
            per = f"{self.kv.bytes_per_cell / 1024:.1f} KiB per token"
            kv = (
                f"{self.kv.cells} tokens ({self.kv.layout}), {_mib(self.kv.bytes or 0)}, {per}"
                if self.kv.cells is not None
                else f"what the GPU's free memory holds ({self.kv.layout}), {per}"
            )
        return [
            ("backend", [f"{self.backend} — {self.reason}"]),
            ("steps", list(self.steps) or ["none"]),
            ("context", [f"{self.n_ctx} tokens" if self.kv is not None else "unknown"]),
            ("kv cache", [kv]),
            ("weights in memory", [_mib(self.weight_bytes)]),
            ("chat template", [self.template.origin if self.template else "none"]),
            ("tool calls", [self.tool_format or "none"]),
            ("reasoning", [self.reasoning or "none"]),
            ("capabilities", [", ".join(self.capabilities) or "none"]),
            ("rerank", [self._rerank()]),
            *([("vision", [self.vision])] if self.vision else []),
        ]

    def _rerank(self) -> str:
        if self.rank_outputs > 2:
            return f"no: a classification head of {self.rank_outputs} classes, not a relevance score"
        if self.rank_outputs:
            return (
                f"cross-encoder: a classification head of {self.rank_outputs} output(s), llama.cpp rank pooling "
                "(/v1/rerank)"
            )
        return "yes/no judge with its chat template (/v1/rerank)" if "rerank" in self.capabilities else "no"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
