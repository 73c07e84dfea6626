"""Pure ASGI middlewares (no BaseHTTPMiddleware, so disconnects still reach handlers): body limit, API key,
request metrics, model leases, and JSON bodies on Ollama's routes whatever their content type."""

from __future__ import annotations

import hmac

from quantserve.server.errors import error_bytes
from quantserve.server.metrics import Metrics

LEASES = "quantserve.leases"  # the scope key of a request's list of model leases

_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/models",
        "/health",
        "/ready",
        "/models/load",
        "/models/unload",
    }
)
# Probes (both spellings) and docs; "/" and /static/*: the chat page, which asks for the key itself.
_OPEN_PATHS = (
    "/health",
    "/healthz",
    "/ready",
    "/readyz",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/",
    "/favicon.ico",
)


async def _send_error(scope, send, status: int, message: str, code: str | None = None, headers=()) -> None:
    body = error_bytes(status, message, code, scope["path"])
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`, by Content-Length or by counting a chunked body (read up front)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = (
            f"request body is larger than the server's limit of {self.max_bytes} bytes (--max-body-bytes)"
        )
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await _send_error(scope, send, 413, too_big, "request_too_large")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_error(scope, send, 413, too_big, "request_too_large")
            if not msg.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class OllamaJsonMiddleware:
    """Ollama reads a request body as JSON whatever its Content-Type, and its docs send bodies with `curl -d`
    (form-encoded by curl's default): on /api/ routes the body is declared JSON, so such requests work here too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/api/")
            and scope["method"] in ("POST", "DELETE")
        ):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """API key check for the API routes, compared in constant time: `Authorization: Bearer KEY` (OpenAI's
    clients) or `x-api-key: KEY` (Anthropic's)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or scope["path"].startswith("/static/"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        if not (bearer or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)):
            return await _send_error(
                scope,
                send,
                401,
                "missing or wrong API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
            )
        await self.app(scope, receive, send)


class RequestMetricsMiddleware:
    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        status = 500

        async def send_wrapper(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"  # bounded label values
            self.metrics.requests.labels(route, str(status)).inc()


class LeaseMiddleware:
    """Gives back the model leases a request took (ServerState.acquire) once its response has been sent, a
    stream's last byte included, or the request failed or its client left: a model never unloads under a request
    in flight, and never stays held by one that is over."""

    def __init__(self, app, router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        leases = scope[LEASES] = []
        try:
            await self.app(scope, receive, send)
        finally:
            self.router.release(leases)
