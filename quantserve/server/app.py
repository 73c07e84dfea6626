"""create_app(settings): the OpenAI-compatible FastAPI app, with health, readiness and metrics routes and the chat
page at /."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from quantserve import __version__
from quantserve.errors import InvalidRequestError
from quantserve.llm import LLM
from quantserve.server.anthropic import routes as anthropic_routes
from quantserve.server.catalog import Prepared, build_router, model_card, served_card
from quantserve.server.errors import error_response, install_error_handlers
from quantserve.server.metrics import Metrics
from quantserve.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    LeaseMiddleware,
    OllamaJsonMiddleware,
    RequestMetricsMiddleware,
)
from quantserve.server.ollama import models as ollama_models
from quantserve.server.ollama import routes as ollama_routes
from quantserve.server.openai import embeddings as openai_embeddings
from quantserve.server.openai import routes as openai_routes
from quantserve.server.rerank import router as rerank_router
from quantserve.server.responses import routes as responses_routes
from quantserve.server.responses.store import ResponseStore
from quantserve.server.settings import ServerSettings, cors_origins
from quantserve.server.state import ServerState

log = logging.getLogger("quantserve.server")

# The chat page's files (quantserve/server/static, shipped as package data) and their types.
_STATIC = {"chat.html": "text/html", "chat.css": "text/css", "chat.js": "text/javascript"}
# Model output reaches the page only as text; this policy would also stop any markup that slipped through
# from running scripts or loading anything from elsewhere.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _static(name: str) -> Response:
    if name not in _STATIC:
        return error_response(404, f"no such file: /static/{name}", "invalid_request_error")
    body = (files("quantserve.server") / "static" / name).read_bytes()
    headers = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}
    return Response(body, media_type=_STATIC[name], headers=headers)


class ModelAction(BaseModel):
    """The body of POST /models/load and /models/unload."""

    model_config = ConfigDict(extra="forbid")
    model: str


def create_app(
    settings: ServerSettings,
    *,
    llm: LLM | None = None,
    prepared: Prepared | None = None,
    on_load_error: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the app. With `llm`, it serves that model. Else, single-model (settings.model): the model loads in
    the background at startup and the API answers 503 until it is ready (GET /ready says when); router mode
    (no model, or --models): models.toml's entries, each loaded on its first request (quantserve.server.router).
    `prepared`: what `serve` already resolved and planned before listening, used as it is.

    Raises:
        ConfigError: router mode with --models naming no entry, or nothing to serve.
    """
    metrics = Metrics()
    router = build_router(settings, metrics, llm=llm, prepared=prepared, on_load_error=on_load_error)
    state = ServerState(router, metrics, media=settings.media_policy())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.start()
        yield
        for llm_ in router.stop():
            await asyncio.to_thread(llm_.close)

    app = FastAPI(title="quantserve", version=__version__, lifespan=lifespan)
    app.state.qs = state
    app.state.settings = settings
    app.state.responses = ResponseStore(settings.responses_store_size)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(openai_embeddings.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(ollama_routes.router)
    app.include_router(ollama_models.router)
    app.include_router(rerank_router)

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return _static("chat.html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():  # a browser asks for it on any page (/health's JSON too): no icon, and no 401
        return Response(status_code=204)

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str):
        return _static(name)

    @app.get("/health")
    @app.get("/healthz")  # the Kubernetes names, as the vision-language server had them
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    @app.get("/readyz")
    async def ready():
        if not router.single:  # the router is up; each model's own state is in /v1/models
            return {"status": "ready", "models": {s.name: s.status for s in router.served_models.values()}}
        served = next(iter(router.served_models.values()))
        if served.llm is not None and (fault := served.llm.fault()):
            return error_response(
                503, f"the model is unavailable: {fault}", "server_error", code="model_unavailable"
            )
        if served.llm is not None:
            return {"status": "ready", "model": served.llm.name}
        if (
            served.parked and served.error is None
        ):  # unloaded at a client's request; the next request loads it
            return {"status": "ready", "model": served.name, "model_status": served.status}
        if served.error is not None:
            return error_response(
                503,
                f"the model failed to load: {served.error.message}",
                "server_error",
                code="model_load_failed",
            )
        return error_response(
            503, "the model is loading", "server_error", code="model_loading", headers={"Retry-After": "1"}
        )

    @app.get("/metrics")
    async def metrics_page():
        for name, llm_ in router.loaded():
            stats = llm_.stats()
            metrics.queue_depth.labels(name).set(stats.waiting)
            metrics.running.labels(name).set(stats.running)
            metrics.kv_cells_used.labels(name).set(stats.kv_cells_used)
            metrics.kv_cells_cached.labels(name).set(stats.kv_cells_cached)
            metrics.steps.labels(name).set(stats.steps)
            for rank, (last, total) in enumerate(stats.rank_step_seconds):
                metrics.rank_step.labels(name, str(rank)).set(last)
                metrics.rank_step_total.labels(name, str(rank)).set(total)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        if router.single:
            only = next(iter(router.served_models.values()))
            if only.parked and only.llm is None:  # unloaded at a client's request: say so
                return {"object": "list", "data": [served_card(only)]}
            return {"object": "list", "data": [model_card(router.single_llm())]}
        return {"object": "list", "data": [served_card(s) for s in router.served_models.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        served = router.find(model_id)
        if router.single and not (served.parked and served.llm is None):
            return model_card(router.single_llm())
        return served_card(served)

    @app.post("/models/load")
    async def load_model(body: ModelAction, request: Request):
        """Admin: load a model now (router mode), waiting until it is ready."""
        if router.single:
            raise InvalidRequestError(
                "this server serves one model; loading is for router mode", param="model"
            )
        leases: list = []
        await router.acquire(leases, body.model)
        router.release(leases)
        return served_card(router.find(body.model))

    @app.post("/models/unload")
    async def unload_model(body: ModelAction):
        """Admin: unload a model once its requests in flight have finished."""
        if router.single:
            raise InvalidRequestError(
                "this server serves one model; unloading is for router mode", param="model"
            )
        return served_card(await router.unload(body.model))

    # Innermost first (the last added runs first): metrics see every status, the key check runs before bodies are
    # read, and a request's leases are given back after its response has been sent.
    app.add_middleware(LeaseMiddleware, router=router)
    app.add_middleware(OllamaJsonMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    if origins := cors_origins(settings.allowed_origins):
        # Outermost: a browser's preflight carries no key, and every answer, errors too, needs the CORS headers
        # for the page to read it.
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    return app
