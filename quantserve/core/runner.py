"""The contract between the engine and a backend's runner.

The engine owns the KV cache's ledger (quantserve.engine.kv): which blocks each sequence holds, what is cached, when
a sequence is preempted. A runner owns only the cache's memory. It says how that memory is laid out (KVSpec), and
each step it executes a scheduled batch over the block tables the engine gave the sequences (`seq.block_table`),
after dropping whatever cached KV the engine tells it to (DropKV). llama.cpp's per-sequence KV streams are the same
contract with one big block per sequence (its slot); its unified pool is blocks of one cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import SampledToken, Sequence
from quantserve.structured import Vocabulary


class KVCacheFull(Exception):
    """Raised by a runner whose cache could not take a batch after all (the engine preempts and goes on). The
    engine's ledger makes this an exception: it plans every step within the cache."""


@dataclass(frozen=True)
class KVSpec:
    """How a runner's KV cache is laid out; the engine builds its ledger from it.

    paged: `num_blocks` blocks of `block_size` tokens, any block for any sequence (the torch backend).
    slots: `num_slots` sequences at once, each in a slot of its own (llama.cpp's seq ids); `shared` puts all
    `cells` in one pool (llama.cpp's unified KV), else each slot holds cells / num_slots.
    """

    layout: Literal["paged", "slots"]
    cells: int  # tokens the cache holds in all
    block_size: int = 1
    num_slots: int = 0
    shared: bool = True
    # one pass over the weights per run of consecutive slots (llama.cpp's split_equal): keep running slots packed
    pack_slots: bool = False
    prefix_cache: bool = True  # KV may outlive its sequence, for the next one with the same prefix
    # slots: the model's windowed layers keep only each sequence's last `window` positions (llama.cpp's SWA cache
    # with swa_full off), so a cached prefix is reusable only where those survive; 0: every position is kept
    window: int = 0
    # paged: a model with linear-attention layers (Qwen3.5's Gated DeltaNet) keeps a fixed-size state per running
    # sequence in one of `state_slots` slots, which the ledger hands out with the blocks (0: no such layers)
    state_slots: int = 0

    @property
    def num_blocks(self) -> int:
        return self.cells // self.block_size


@dataclass(frozen=True)
class DropKV:
    """The KV of slot `slot` from position `start` on is no longer valid (llama_memory_seq_rm)."""

    slot: int
    start: int = 0


@dataclass(frozen=True)
class CopyKV:
    """Slot `dst` takes the KV of slot `src`'s first `n` positions, and nothing else (llama_memory_seq_cp, then
    llama_memory_seq_rm from `n`): a prefix computed once serves sequences in other slots."""

    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class VisionSpec:
    """A runner that takes images: the chat template marks each image with `image_token` (a special token of the
    model's own vocabulary), and the runner needs that token repeated `tokens_per_image` times in the prompt, one
    position for each embedding its vision encoder produces (quantserve.core.multimodal)."""

    image_token: int
    tokens_per_image: int


class Tokenizer(Protocol):
    """What the engine and the LLM API ask of a model's tokenizer."""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token prints; control tokens print nothing unless `special`."""
        ...

    def is_eog(self, token: int) -> bool: ...

    @property
    def bos_token(self) -> int:
        """The BOS token's id; -1 when the vocabulary has none."""
        ...

    def adds_bos(self) -> bool: ...


class ModelRunner(Tokenizer, Protocol):
    """One model on one backend: its vocabulary, its KV cache's memory, and the forward pass plus sampling."""

    n_ctx: int  # longest sequence (prompt + output) the runner accepts
    n_vocab: int
    scored_by: str  # what `quantserve eval` says scored a text: "llama.cpp", "torch (cuda, bfloat16)"
    kv_spec: KVSpec
    vision: VisionSpec | None  # None: text only

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError now if this backend cannot honour `params`."""
        ...

    def vocabulary(self) -> Vocabulary:
        """The vocabulary as the grammar engine reads it (quantserve.structured)."""
        ...

    def drop_kv(self, ops: list[DropKV | CopyKV]) -> None:
        """Invalidate cached KV, and copy prefixes between slots, as the engine's ledger says (a runner with a
        paged cache has nothing to do; only the slot ledger copies)."""
        ...

    def execute(self, plan: list[tuple[Sequence, int]]) -> list[SampledToken | None]:
        """Feed the first n uncomputed tokens of each planned sequence in one batch, their K/V into the cache at
        their block tables. For each sequence whose tokens are then all computed (num_computed + n is all of
        them), sample its next token; the others get None. A runner never writes num_computed: the scheduler
        advances it once the step has run (Scheduler.postprocess)."""
        ...

    def release(self, seq: Sequence, *, keep_sampler: bool = False) -> None:
        """Forget the sequence's sampling state (kept for a preempted sequence that will recompute)."""
        ...

    def embed(self, tokens: list[int]) -> list[float]:
        """One input's mean-pooled, L2-normalised final hidden states (/v1/embeddings)."""
        ...

    def score(self, tokens: list[int], first: int) -> Any:
        """Log-probabilities [len(tokens) - first - 1, vocab] (a numpy array) of each position's next token from
        `first` on, for perplexity and KL (quantserve.evaluate)."""
        ...

    def num_kv_used(self) -> int | None:
        """Cells holding KV by the runner's own count (leak checks); None where it keeps no count of its own."""
        ...

    def close(self) -> None: ...

    # ---- optional features: RunnerBase gives every runner their defaults ----

    rank_labels: tuple[str, ...]  # a reranker's head names its outputs ("yes", "no"); () otherwise

    @property
    def gpu_share(self) -> float:
        """The share of the model's layers on a GPU: 0 on the CPU, 1 all on one."""
        ...

    def fault(self) -> str | None:
        """Why the model cannot run any more (a tensor-parallel rank is gone), or None."""
        ...

    def rank_step_seconds(self) -> list[tuple[float, float]]:
        """(last step, all steps) in seconds per tensor-parallel rank; [] for a model in one process."""
        ...


class RunnerBase:
    """The defaults of ModelRunner's optional features, for a runner to inherit: no reranker labels, all on the
    CPU, never faulted, one process."""

    rank_labels: tuple[str, ...] = ()

    @property
    def gpu_share(self) -> float:
        return 0.0

    def fault(self) -> str | None:
        return None

    def rank_step_seconds(self) -> list[tuple[float, float]]:
        return []


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/models and the logs say about the served model."""

    architecture: str
    n_params: int
    format: str  # the served weights: gguf, gptq, awq, marlin, compressed-tensors, safetensors
    backend: str  # llamacpp | torch


@dataclass(frozen=True)
class EngineStats:
    """A loaded model's engine now, for /metrics."""

    waiting: int  # queued, not yet scheduled
    running: int
    kv_cells_used: int  # KV cells holding tokens (llama.cpp's own count where it keeps one)
    kv_cells_cached: int  # of those, cells kept only as prefix cache
    steps: int = 0  # engine steps run since the model loaded
    # tensor parallel: each rank's (last step, all steps) in seconds; empty for one process
    rank_step_seconds: tuple[tuple[float, float], ...] = ()


@dataclass
class Loaded:
    """What a backend's load() hands to quantserve.llm.LLM: the running model, and what it learned loading it."""

    runner: ModelRunner
    info: ModelInfo
    bos_token: str  # the BOS and EOS as text, for chat templates that write them
    eos_token: str
    keep_alive: Any = None  # e.g. a temporary conversion directory, released with the model
