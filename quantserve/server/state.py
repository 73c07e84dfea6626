"""ServerState: the loaded model (or why it is not loaded yet), and the metrics, held on app.state.qs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from quantserve.errors import ModelLoadingError, ModelNotFoundError, QuantserveError
from quantserve.llm import LLM
from quantserve.server.content import ContentReader
from quantserve.server.metrics import Metrics
from quantserve.vision.fetch import MediaPolicy


@dataclass
class ServerState:
    metrics: Metrics = field(default_factory=Metrics)
    llm: LLM | None = None
    load_error: QuantserveError | None = None
    model_names: frozenset[str] = frozenset()  # names a request's "model" may use (name, aliases, file name)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # image limits and the URL policy

    def reader(self, llm: LLM) -> ContentReader:
        """A reader of one request's message content for `llm` (see quantserve.server.content)."""
        return ContentReader(llm.name, llm.takes_images, self.media.limits.max_images)

    def require_model(self, requested: str | None) -> LLM:
        if self.llm is None:
            if self.load_error is not None:
                raise ModelLoadingError(f"the model failed to load: {self.load_error.message}")
            raise ModelLoadingError(
                "the model is still loading; retry shortly (GET /ready says when it is ready)"
            )
        if requested and requested not in self.model_names:
            raise ModelNotFoundError(
                f"the model {requested!r} does not exist; this server serves {self.llm.name!r}", param="model"
            )
        return self.llm

    def observe_ttft(self, t0: float) -> None:
        self.metrics.ttft.observe(time.perf_counter() - t0)

    def record(self, choices, prompts, t0: float) -> None:
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        self.metrics.completion_tokens.inc(sum(c.num_output_tokens for c in choices))
        self.metrics.latency.observe(time.perf_counter() - t0)
