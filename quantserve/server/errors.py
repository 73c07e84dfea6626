"""Maps exception types to each API's error object: OpenAI's {"error": {message, type, param, code}}, Anthropic's
{"type": "error", "error": {type, message}} under /v1/messages and Ollama's {"error": message} under /api/."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantserve.errors import QuantserveError

log = logging.getLogger("quantserve.server")

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_error",
}


ANTHROPIC_ROUTES = "/v1/messages"  # and /v1/messages/count_tokens
OLLAMA_ROUTES = "/api/"  # Ollama's native API: {"error": "..."}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def anthropic_error_body(message: str, type_: str) -> dict:
    return {"type": "error", "error": {"type": type_, "message": message}}


def _body_for(path: str, status: int, message: str, type_: str, param=None, code=None) -> dict:
    if path.startswith(ANTHROPIC_ROUTES):
        return anthropic_error_body(message, _ANTHROPIC_TYPES.get(status, "api_error"))
    if path.startswith(OLLAMA_ROUTES):
        return {"error": message}
    return error_body(message, type_, param, code)


def error_response(
    status: int, message: str, type_: str, param=None, code=None, headers=None, path: str = ""
) -> JSONResponse:
    body = _body_for(path, status, message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def error_bytes(status: int, message: str, code: str | None = None, path: str = "") -> bytes:
    return json.dumps(
        _body_for(path, status, message, _HTTP_TYPES.get(status, "server_error"), None, code)
    ).encode()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is invalid", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # pydantic puts the union member tried into loc (e.g. 'str', 'list[str]'); keep the field path only.
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    if e.get("type") == "missing":
        return f"'{param}' is a required field", param
    if param is None:
        return f"the request body is invalid: {e.get('msg')}", None
    return f"invalid value for '{param}': {e.get('msg')} (got {e.get('input')!r:.200})", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(QuantserveError)
    async def _quantserve(request: Request, exc: QuantserveError) -> JSONResponse:
        # a busy or loading server: retry soon; a model that failed to load: retrying at once will not help
        headers = {"Retry-After": "1"} if exc.http_status == 503 and exc.code != "model_load_failed" else None
        return error_response(
            exc.http_status, exc.message, exc.error_type, exc.param, exc.code, headers, request.url.path
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(
            400, message, "invalid_request_error", param, "invalid_request", path=request.url.path
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if status == 404:
            message = "no such route; see /docs for the API"
        return error_response(status, message, _HTTP_TYPES.get(status, "server_error"), path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        message = f"internal error: {type(exc).__name__}: {exc}"
        return error_response(500, message, "server_error", path=request.url.path)
