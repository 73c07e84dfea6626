"""The models a server's settings ask for, as the router's served models: one MODEL, or models.toml's entries
(router mode), each with what is known before it loads (context length, backend, inputs, memory estimate)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from quantserve.core.settings import EngineSettings
from quantserve.errors import ConfigError, QuantserveError
from quantserve.llm import LLM
from quantserve.registry import (
    Registry,
    ResolvedModel,
    find_models_toml,
    is_hub_id,
    load_registry,
    parse_duration,
    resolve,
)
from quantserve.server import memory
from quantserve.server.metrics import Metrics
from quantserve.server.router import ModelRouter
from quantserve.server.served import Served, ServedInfo
from quantserve.server.settings import ServerSettings

log = logging.getLogger("quantserve.server")


def _names(resolved: ResolvedModel) -> frozenset[str]:
    return frozenset(n.lower() for n in (resolved.name, resolved.path.name, *resolved.entry.aliases))


def _router_served(name: str, registry, base: EngineSettings, keep_alive: float | None) -> Served:
    entry = registry.entries[name]
    idle = keep_alive if entry.keep_alive is None else parse_duration(entry.keep_alive, "keep_alive")
    # a torch model on CUDA takes the KV cache it needs, not the free memory: other models share the GPU
    settings = replace(base, torch=replace(base.torch, kv_fill_gpu=False))

    def setup() -> ServedInfo:
        resolved = resolve(name, registry)
        return ServedInfo(resolved, LLM.plan_for(resolved, settings), _names(resolved))

    def preflight() -> None:
        """The model planned again (its files may have changed since startup), and the plan's checks run (a GGUF
        that llama.cpp loads as it is gets its probe, cached), before any model unloads for it."""
        assert served.resolved is not None
        served.set_plan(LLM.plan_for(served.resolved, settings))
        LLM.check(served.plan)

    served = Served(name, None, settings, entry.pin, idle, setup=setup, preflight=preflight)
    served.names = frozenset(n.lower() for n in (name, *entry.aliases))
    if is_hub_id(entry.source, registry.path.parent if registry.path else Path.cwd()):
        return served  # downloaded on its first request, not before the server listens
    try:
        info = setup()
    except QuantserveError as exc:  # served as a 503 naming this, while the others work; retried at load
        log.error("model %s cannot be served: %s", name, exc.message)
        served.error = exc
    except Exception as exc:  # a bug or an unreadable file: the same, and the traceback for the log
        log.exception("model %s cannot be served", name)
        served.error = QuantserveError(f"{type(exc).__name__}: {exc}")
    else:
        served.resolve(info)
    return served


@dataclass(frozen=True)
class Prepared:
    """What `quantserve run` reads before it listens, kept for the app so that nothing is read twice: models.toml
    (router mode), or the one model resolved and planned (single-model mode; its first load carries this plan out)."""

    registry: Registry | None = None
    model: ServedInfo | None = None


def prepare(settings: ServerSettings) -> Prepared:
    """Read models.toml (router mode), or resolve and plan the one model: its files validated before any C code
    sees them, its settings checked.

    Raises:
        QuantserveError: the model cannot be found, its files are malformed, or a setting is refused.
    """
    if settings.router_mode:
        return Prepared(registry=load_registry(find_models_toml(settings.models_file)))
    resolved, engine = settings.resolve_model()
    return Prepared(model=ServedInfo(resolved, LLM.plan_for(resolved, engine), _names(resolved)))


def build_router(
    settings: ServerSettings,
    metrics: Metrics,
    *,
    llm: LLM | None = None,
    prepared: Prepared | None = None,
    on_load_error=None,
) -> ModelRouter:
    """The router for these settings: one model (MODEL, or `llm` already loaded) or models.toml's entries;
    `prepared`, where given, is what prepare() read.

    Raises:
        ConfigError: --models names an entry models.toml does not have, or there is nothing to serve.
    """
    if llm is not None:
        served = Served(llm.name, None, llm.settings, pinned=True, names=frozenset({llm.name.lower()}))
        served.llm, served.status = llm, "loaded"
        metrics.ready.labels(llm.name).set(1)
        return ModelRouter([served], metrics, single=True)
    base = settings.engine_settings()
    if not settings.router_mode:
        if prepared is not None and prepared.model is not None:
            info = prepared.model
            served = Served(info.resolved.name, None, base, pinned=True)
            served.resolve(info)  # the load carries out this plan: the model is planned once
            return ModelRouter([served], metrics, single=True, on_load_error=on_load_error)
        try:
            resolved, _ = settings.resolve_model()
        except QuantserveError as exc:  # `quantserve run` checks this before listening; an app made in code
            served = Served(settings.model, None, base, pinned=True, error=exc)
        else:
            served = Served(resolved.name, resolved, base, pinned=True, names=_names(resolved))
        return ModelRouter([served], metrics, single=True, on_load_error=on_load_error)

    if prepared is not None and prepared.registry is not None:
        registry = prepared.registry
    else:
        registry = load_registry(find_models_toml(settings.models_file))
    where = registry.path or "models.toml"
    if not registry.entries:
        raise ConfigError(
            f"no models to serve: {where} has no [models.*] entries; give a MODEL (a path or hub id)"
        )
    wanted = (settings.models or "all").strip()
    if wanted.lower() == "all":
        names = registry.names()
    else:
        names = []
        for item in (n.strip() for n in wanted.split(",") if n.strip()):
            hit = registry.lookup(item)
            if hit is None:
                raise ConfigError(
                    f"--models {item!r}: no such entry in {where} (known: {', '.join(registry.names())})",
                    param="models",
                )
            names.append(hit[0])
    keep_alive = parse_duration(settings.keep_alive, "--keep-alive") if settings.keep_alive else None
    served_models = [_router_served(name, registry, base, keep_alive) for name in dict.fromkeys(names)]
    budget = memory.parse_size(settings.memory_budget) if settings.memory_budget else 0
    return ModelRouter(
        served_models, metrics, default=registry.default, models_max=settings.models_max, memory_budget=budget
    )


def model_card(llm: LLM) -> dict:
    """/v1/models' entry for a loaded model: OpenAI's fields, plus what it is and can do (its plan's)."""
    info, plan = llm.info, llm.plan
    return {
        "id": llm.name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "quantserve",
        "context_length": llm.n_ctx,
        "max_model_len": llm.n_ctx,
        "capabilities": list(plan.capabilities),
        "meta": {
            "architecture": info.architecture,
            "n_params": info.n_params,
            "format": info.format,
            "backend": info.backend,
            "has_chat_template": llm.chat_template is not None,
            "tool_format": plan.tool_format,  # how its template writes tool calls (hermes, llama3, …)
            "reasoning_format": plan.reasoning,  # how it marks its thinking (think (<think>…</think>), …)
            "input_modalities": ["text", "image"] if "vision" in plan.capabilities else ["text"],
        },
    }


def served_card(served: Served) -> dict:
    """/v1/models' entry in router mode: the loaded model's card, or what is known before loading, with its
    status (loaded, loading, unloading, unloaded), the last load error, and the router's settings for it."""
    if served.llm is not None:
        card = model_card(served.llm)
        card["id"] = served.name
    else:
        facts = dict(served.facts)
        ctx = facts.pop("context_length", None)
        card = {
            "id": served.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "quantserve",
            "context_length": ctx,
            "max_model_len": ctx,
            "capabilities": facts.pop("capabilities", []),
            "meta": facts,
        }
    card["status"] = served.status
    card["meta"] |= {
        "pinned": served.pinned,
        "keep_alive": served.keep_alive,
        "memory_estimate_bytes": served.estimate,
        "aliases": sorted(served.names - {served.name.lower()}),
    }
    if served.error is not None and served.llm is None:
        card["error"] = served.error.message
    return card
