"""ServerState: the models (a ModelRouter), the metrics and the image policy, held on app.state.qs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from quantserve.llm import LLM
from quantserve.server.content import ContentReader
from quantserve.server.metrics import Metrics
from quantserve.server.middleware import LEASES
from quantserve.server.router import ModelRouter
from quantserve.vision.fetch import MediaPolicy


@dataclass
class ServerState:
    router: ModelRouter
    metrics: Metrics = field(default_factory=Metrics)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # image limits and the URL policy
    copies: dict[str, str] = field(
        default_factory=dict
    )  # Ollama's /api/copy: a new name -> the model's served

    async def acquire(self, request: Request, requested: str | None) -> LLM:
        """The model a request names, loaded, and held for the request until its response is sent."""
        return await self.router.acquire(request.scope[LEASES], requested)

    def reader(self, llm: LLM) -> ContentReader:
        """A reader of one request's message content for `llm` (see quantserve.server.content)."""
        return ContentReader(llm.name, llm.takes_images, self.media.limits.max_images)

    def observe_ttft(self, llm: LLM, t0: float) -> None:
        self.metrics.ttft.labels(llm.name).observe(time.perf_counter() - t0)

    def record(self, llm: LLM, choices, prompts, t0: float) -> None:
        self.metrics.prompt_tokens.labels(llm.name).inc(sum(len(p) for p in prompts))
        self.metrics.completion_tokens.labels(llm.name).inc(sum(c.num_output_tokens for c in choices))
        self.metrics.latency.labels(llm.name).observe(time.perf_counter() - t0)
