"""Backends: each turns scheduled token batches into sampled tokens (llama.cpp today; torch next)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from quantserve.engine.sampling_params import SamplingParams
from quantserve.engine.sequence import SampledToken, Sequence


class KVCacheFull(Exception):
    """Raised by a runner when a batch found no KV room; the engine preempts a sequence and retries."""


class ModelRunner(Protocol):
    """What the engine needs from a backend. One runner owns one model and its KV cache."""

    n_ctx: int  # longest sequence (prompt + output) the runner accepts
    n_vocab: int
    n_kv_cells: int  # KV capacity of all sequences together, in tokens
    kv_unified: bool  # one pool for all sequences (else n_kv_cells / max_num_seqs each)
    supports_prefix_cache: bool  # free slots may keep their KV for the next request's shared prefix
    kv_block_size: int  # KV is allocated in blocks of this many tokens (1: per token)
    batches_slot_runs: bool  # one pass over the weights per run of consecutive slot ids (else one per batch)

    def adds_bos(self) -> bool: ...

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError now if this backend cannot honour `params` (e.g. a grammar)."""
        ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def execute(self, plan: list[tuple[Sequence, int]]) -> list[SampledToken | None]:
        """Feed the first n uncomputed tokens of each planned sequence in one batch. For each planned sequence
        whose tokens are then all computed, sample its next token; others get None."""
        ...

    def free(self, seq: Sequence, *, keep_sampler: bool = False, keep_kv: bool = False) -> None:
        """Release the sequence's sampler (unless kept for a recompute) and its KV (unless kept as a prefix cache
        in its slot)."""
        ...

    def clear_slot(self, slot: int) -> None:
        """Drop all KV cached in a free slot."""
        ...

    def reuse_slot(self, seq: Sequence) -> None:
        """`seq` was admitted to slot seq.seq_id with its first seq.num_computed tokens already cached there;
        drop the slot's KV past them."""
        ...


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/models and the logs say about the served model."""

    architecture: str
    n_params: int
    format: str  # the served weights: gguf, gptq, awq, marlin, compressed-tensors, safetensors
    backend: str  # llamacpp | torch


@dataclass
class LoadedModel:
    """What a backend's loader hands to quantserve.llm.LLM."""

    runner: Any  # a ModelRunner
    info: ModelInfo
    chat_template: str | None  # the model's own template source, if it has one
    template_origin: str
    bos_token: str
    eos_token: str
    keep_alive: Any = None  # e.g. a temporary conversion directory, released with the model
