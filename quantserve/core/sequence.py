"""A Sequence: one stream of tokens being generated, with its status and KV bookkeeping."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.multimodal import ImageSpan
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.thinking import ThinkState

if TYPE_CHECKING:
    from quantserve.structured import Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) best first
    asked: tuple[float, ...] = ()  # the logprobs of SamplingParams.logprob_tokens, in their order


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: TokenLogprob | None = None


@dataclass
class SequenceOutput:
    """What one engine step produced for one sequence; `finish_reason` is set on its last output."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stop: str | None = None  # the stop string that ended the sequence, if one did
    num_reasoning_tokens: int = 0  # of num_output_tokens, those inside the reasoning block


_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """`tokens` is prompt + output. The first `num_computed` tokens are in the KV cache; every token after them
    is fed to the model by the next step that schedules this sequence (a prefill chunk, or one decode token).

    `block_table` is its KV handle, set by the engine's KV ledger while it runs: the cache blocks holding its
    tokens in order (a llama.cpp slot: one block, the slot's number)."""

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    max_total_tokens: int  # context limit for this sequence (prompt + output)
    seq_id: int = field(default_factory=lambda: next(_counter))  # identity, in order of arrival
    status: SequenceStatus = SequenceStatus.WAITING
    tokens: list[int] = field(init=False)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    # its recurrent-state slot while it runs, for a model with linear-attention layers (Qwen3.5), else -1; set by
    # the KV ledger with the block table
    state_slot: int = -1
    pending_tokens: list[int] = field(default_factory=list)  # sampled but not yet sent (text held back)
    guide: Guide | None = None  # the grammar its output must follow (params.grammar), if any
    stop_hit: str | None = None  # the stop string that ended it
    images: list[ImageSpan] = field(default_factory=list)  # images in the prompt, in order
    thinking: ThinkState | None = None  # its reasoning block (params.thinking), if it has one

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_tokens)
        if self.params.thinking is not None:
            self.thinking = ThinkState(self.params.thinking)

    @property
    def cache_tokens(self) -> list:
        """`tokens` as the KV prefix caches compare them: an image's positions become (digest, index)
        pairs, so that a cached prefix matches only the same images."""
        if not self.images:
            return self.tokens
        out: list = list(self.tokens)
        for span in self.images:
            out[span.offset : span.end] = [(span.image.digest, j) for j in range(span.length)]
        return out

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - len(self.prompt_tokens)

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[len(self.prompt_tokens) :]
