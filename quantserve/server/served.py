"""Served: one model a server can serve, and where it stands (unloaded, loading, loaded, unloading); the state
quantserve.server.router keeps per model, and ServedInfo, what a models.toml entry resolves to before it loads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from quantserve.core.plan import ModelPlan
from quantserve.core.settings import EngineSettings
from quantserve.errors import QuantserveError
from quantserve.llm import LLM
from quantserve.registry import ResolvedModel

Status = Literal["unloaded", "loading", "loaded", "unloading"]


@dataclass(frozen=True)
class ServedInfo:
    """What a router-mode entry resolves to before it loads (quantserve.server.catalog)."""

    resolved: ResolvedModel
    plan: ModelPlan
    names: frozenset[str]


def plan_facts(plan: ModelPlan) -> dict:
    """What /v1/models says of a model that is not loaded: its plan's context, backend and capabilities."""
    return {
        "context_length": plan.n_ctx or None,
        "backend": plan.backend,
        "format": plan.spec.format,
        "architecture": plan.architecture,
        "tool_format": plan.tool_format,
        "input_modalities": ["text", "image"] if "vision" in plan.capabilities else ["text"],
        "capabilities": list(plan.capabilities),
    }


@dataclass(eq=False)
class Served:
    """One servable model and where it stands: unloaded, loading, loaded or unloading."""

    name: str
    resolved: ResolvedModel | None  # None: the entry could not be resolved (`error` says why)
    settings: EngineSettings
    pinned: bool = False
    keep_alive: float | None = None  # idle seconds before it unloads; None: never
    plan: ModelPlan | None = None  # how it will load (router mode: planned at startup, planned again at load)
    facts: dict = field(default_factory=dict)  # plan_facts(plan)
    estimate: int = 0  # bytes: weights plus KV (ModelPlan.memory_bytes)
    names: frozenset[str] = frozenset()  # lower-cased names a request may use: name, aliases, file name
    status: Status = "unloaded"
    llm: LLM | None = None
    error: QuantserveError | None = None  # why the last load failed
    failed_at: float = 0.0  # when (time.monotonic)
    task: asyncio.Task | None = None  # the load or unload under way
    leases: int = 0  # requests using the model now
    pending: int = 0  # requests waiting on its load; the load hands each a lease
    last_used: float = 0.0
    # a client has asked for it to unload (Ollama's keep_alive, now or once idle): from then on a single-model
    # server loads it again on the next request instead of answering 503
    parked: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no lease is held
    # router mode: resolves the entry and reads its facts; run again at load time while `resolved` is None, so a
    # file put right after startup is found (and a hub model is downloaded on its first request, not at startup)
    setup: Callable[[], ServedInfo] | None = None
    # router mode: plans the model again and runs the plan's checks (the GGUF probe) before any model unloads to
    # make room, so a broken model never costs a working one its place
    preflight: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.idle.set()

    def resolve(self, info: ServedInfo) -> None:
        self.resolved, self.names = info.resolved, info.names
        self.set_plan(info.plan)

    def set_plan(self, plan: ModelPlan) -> None:
        self.plan, self.facts, self.estimate = plan, plan_facts(plan), plan.memory_bytes
