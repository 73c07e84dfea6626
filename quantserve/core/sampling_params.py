"""Per-request sampling parameters, validated once at the boundary and frozen afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantserve.core.thinking import ThinkingSpec
from quantserve.errors import InvalidRequestError
from quantserve.structured.grammars import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops.

    `temperature == 0` means greedy. `top_k <= 0`, `top_p == 1` and `min_p == 0` disable those filters.
    Penalties follow llama.cpp: `repeat_penalty` divides positive logits of tokens seen in the last
    `penalty_last_n` generated tokens; `presence_penalty`/`frequency_penalty` are OpenAI's additive ones.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # with logprobs: these tokens' logprobs are reported too, whatever was sampled (the reranker's yes and no)
    logprob_tokens: tuple[int, ...] = ()
    grammar: Grammar | None = None  # the output must match it (a token mask from llguidance, both backends)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # control tokens print nothing (False: they print their text, so tool-call markers can be parsed)
    skip_special_tokens: bool = True
    thinking: ThinkingSpec | None = None  # a reasoning block to count, and to close once its budget is spent

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be between 0 and 1"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("repeat_penalty", self.repeat_penalty > 0.0, "must be greater than 0"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be between 0 and 20"),
            ("stop", len(self.stop) <= 16, "accepts at most 16 sequences"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"'{name}' {why}; got {getattr(self, name)!r}", param=name)
        if any(not s for s in self.stop):
            raise InvalidRequestError("'stop' sequences must be non-empty strings", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
