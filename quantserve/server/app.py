"""create_app(settings): the OpenAI-compatible FastAPI app, with health, readiness and metrics routes and the chat
page at /."""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib.resources import files

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quantserve import __version__
from quantserve.errors import EmbeddingsUnsupportedError, InvalidRequestError, QuantserveError
from quantserve.llm import LLM
from quantserve.server.anthropic import routes as anthropic_routes
from quantserve.server.errors import error_response, install_error_handlers
from quantserve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestMetricsMiddleware
from quantserve.server.openai import routes as openai_routes
from quantserve.server.openai.protocol import EmbeddingRequest
from quantserve.server.responses import routes as responses_routes
from quantserve.server.responses.store import ResponseStore
from quantserve.server.settings import ServerSettings
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


def create_app(
    settings: ServerSettings, *, llm: LLM | None = None, on_load_error: Callable[[], None] | None = None
) -> FastAPI:
    """Build the app. Without `llm`, the model named in settings loads in the background at startup, and the API
    answers 503 until it is ready (GET /ready says when)."""
    state = ServerState(media=settings.media_policy())

    def load() -> None:
        try:
            resolved, engine_settings = settings.resolve_model()
            t = time.perf_counter()
            loaded = LLM.load(resolved, engine_settings)
            names = {loaded.name, resolved.name, resolved.path.name, *resolved.entry.aliases}
            state.model_names = frozenset(names)
            state.llm = loaded
            state.metrics.ready.set(1)
            log.info(
                "model %s ready in %.1fs: n_ctx %d, %d sequences",
                loaded.name,
                time.perf_counter() - t,
                loaded.n_ctx,
                engine_settings.max_num_seqs,
            )
        except QuantserveError as exc:
            state.load_error = exc
            log.error("could not load the model: %s", exc.message)
        except Exception as exc:  # a bug, not a user error; keep the message for /ready
            state.load_error = QuantserveError(f"{type(exc).__name__}: {exc}")
            log.exception("could not load the model")
        if state.load_error is not None and on_load_error is not None:
            on_load_error()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if llm is not None:
            state.llm = llm
            state.model_names = frozenset({llm.name})
            state.metrics.ready.set(1)
        else:
            threading.Thread(target=load, name="quantserve-load", daemon=True).start()
        yield
        if state.llm is not None:
            state.llm.close()

    app = FastAPI(title="quantserve", version=__version__, lifespan=lifespan)
    app.state.qs = state
    app.state.settings = settings
    app.state.responses = ResponseStore(settings.responses_store_size)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return _static("chat.html")

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
        if state.llm is not None:
            return {"status": "ready", "model": state.llm.name}
        if state.load_error is not None:
            return error_response(
                503,
                f"the model failed to load: {state.load_error.message}",
                "server_error",
                code="model_load_failed",
            )
        return error_response(
            503, "the model is loading", "server_error", code="model_loading", headers={"Retry-After": "1"}
        )

    @app.get("/metrics")
    async def metrics():
        if state.llm is not None:
            stats = state.llm.stats()
            state.metrics.queue_depth.set(stats.waiting)
            state.metrics.running.set(stats.running)
            state.metrics.kv_cells_used.set(stats.kv_cells_used)
            state.metrics.kv_cells_cached.set(stats.kv_cells_cached)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(llm_: LLM) -> dict:
        info = llm_.info
        return {
            "id": llm_.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "quantserve",
            "context_length": llm_.n_ctx,
            "max_model_len": llm_.n_ctx,
            "meta": {
                "architecture": info.architecture,
                "n_params": info.n_params,
                "format": info.format,
                "backend": info.backend,
                "has_chat_template": llm_.chat_template is not None,
                "tool_format": llm_.tool_format,  # how its template writes tool calls (hermes, llama3, …)
                "input_modalities": ["text", "image"] if llm_.takes_images else ["text"],
            },
        }

    @app.get("/v1/models")
    async def list_models():
        llm_ = state.require_model(None)
        return {"object": "list", "data": [model_card(llm_)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        return model_card(state.require_model(model_id))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        llm_ = state.require_model(body.model)
        if body.dimensions is not None:
            raise EmbeddingsUnsupportedError(
                "'dimensions' is not supported by this model", param="dimensions"
            )
        inputs = body.input
        if isinstance(inputs, str):
            batches = [llm_.tokenize_prompt(inputs, chat=False)]
        elif inputs and all(isinstance(x, int) for x in inputs):
            batches = [list(inputs)]
        else:
            batches = [llm_.tokenize_prompt(x, chat=False) if isinstance(x, str) else list(x) for x in inputs]
        if not batches or any(not b for b in batches):
            raise InvalidRequestError("'input' must not be empty", param="input")
        data = []
        for i, tokens in enumerate(batches):
            vec = await llm_.embed(tokens)
            if body.encoding_format == "base64":  # what the openai client asks for: little-endian float32
                vec = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": vec})
        n = sum(len(b) for b in batches)
        return {
            "object": "list",
            "data": data,
            "model": llm_.name,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    # Outermost first: metrics see every status, the key check runs before bodies are read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    return app
