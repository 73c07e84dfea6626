"""Ollama's native API (docs/api.md of the ollama repository): request bodies, `options` onto our sampling,
Ollama's messages onto the chat path's, model names with their tags, and NDJSON streams. Unknown fields are ignored, as Ollama ignores them; a field of the wrong
type is a 400 naming it."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from quantserve.chat import ChatRequest
from quantserve.chat.tools import ToolChoice, parse_openai_tools
from quantserve.errors import InvalidRequestError, QuantserveError
from quantserve.server.content import ContentReader

log = logging.getLogger("quantserve.server")
NDJSON = "application/x-ndjson"

_LENIENT = ConfigDict(extra="ignore", populate_by_name=True)


class Options(BaseModel):
    """The Modelfile parameters a request may set. Those that size or place the model (num_ctx, num_gpu,
    num_thread, ...) are the server's, set when it starts: accepted and left alone, as is mirostat."""

    model_config = _LENIENT
    num_ctx: int | None = None
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields (None: the model's default). num_predict -1 (Ollama's "until the context is
        full") and -2 (fill the context) leave max_tokens to the context check."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repeat_penalty": self.repeat_penalty,
            "penalty_last_n": self.repeat_last_n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "stop": tuple(self.stop) if self.stop else None,
        }

    @property
    def max_tokens(self) -> int | None:
        return self.num_predict if self.num_predict is not None and self.num_predict > 0 else None


Format = Literal["", "json"] | dict[str, Any] | None
KeepAlive = float | int | str | None
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def keep_alive_seconds(value: KeepAlive) -> float | None:
    """Ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m", "-1s"); None for a
    negative one (stay loaded), 0 to unload now.

    Raises:
        InvalidRequestError: anything else.
    """
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)  # "300", as Ollama also takes
        except ValueError:
            parts = _GO_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise InvalidRequestError(
                    f'\'keep_alive\' {value!r} is not a duration; write e.g. 300, "5m", "1h30m", 0 or -1',
                    param="keep_alive",
                ) from None
            seconds = sign * sum(float(n) * _GO_UNITS[u] for n, u in parts)
    return None if seconds < 0 else seconds


class Message(BaseModel):
    model_config = _LENIENT
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None  # base64
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ChatBody(BaseModel):
    model_config = _LENIENT
    model: str = Field(min_length=1)
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None
    format: Format = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | Literal["low", "medium", "high"] | None = None


class GenerateBody(BaseModel):
    model_config = _LENIENT
    model: str = Field(min_length=1)
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    format: Format = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | Literal["low", "medium", "high"] | None = None


class EmbedBody(BaseModel):
    model_config = _LENIENT
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    options: Options | None = None
    keep_alive: KeepAlive = None
    dimensions: int | None = None


class EmbeddingsBody(BaseModel):
    """The older /api/embeddings: one prompt, one vector (unit length here; Ollama's is not normalised)."""

    model_config = _LENIENT
    model: str = Field(min_length=1)
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAlive = None


class NameBody(BaseModel):
    """/api/show, /api/pull, /api/delete: the model (older clients call it `name`)."""

    model_config = _LENIENT
    model: str | None = None
    name: str | None = None
    verbose: bool = False
    stream: bool = True

    @property
    def target(self) -> str:
        given = self.model or self.name
        if not given:
            raise InvalidRequestError("'model' is required", param="model")
        return given


class CopyBody(BaseModel):
    model_config = _LENIENT
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


def response_schema(fmt: Format) -> dict[str, Any] | None:
    """`format`: "json" (any JSON object) or a JSON schema the reply must match."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "object"}
    if isinstance(fmt, dict):
        return fmt
    raise InvalidRequestError("'format' must be \"json\" or a JSON schema object", param="format")


def image_part(b64: str, where: str, reader: ContentReader) -> dict[str, Any]:
    """An Ollama image (base64 bytes, any image format) as the chat path's image part."""
    return reader.part({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}, where)


def chat_request(body: ChatBody, reader: ContentReader) -> ChatRequest:
    """Ollama's chat as the library's ChatRequest. An assistant turn's calls get ids that the tool turns after
    it answer in order (Ollama's messages carry no ids: a tool turn names its function, or none)."""
    messages: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        content: Any = m.content or ""
        if m.images:
            if m.role != "user":
                raise InvalidRequestError(f"'{where}.images': images belong to user messages", param=where)
            parts: list[Any] = [image_part(b, f"{where}.images[{j}]", reader) for j, b in enumerate(m.images)]
            content = [*parts, {"type": "text", "text": content}] if content else parts
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.role == "assistant" and m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidRequestError(
                        f"'{where}.tool_calls[{j}].function.name' is required", param=f"{where}.tool_calls"
                    )
                args = fn.get("arguments", {})
                call_id = f"call_{i}_{j}"
                open_calls.append((call_id, fn["name"]))
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(
                    {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": text}}
                )
            msg["tool_calls"] = calls
        if m.role == "tool":
            k = next(
                (n for n, (_, name) in enumerate(open_calls) if name == m.tool_name),
                0 if open_calls else None,
            )
            call_id, name = open_calls.pop(k) if k is not None else (f"call_{i}", m.tool_name or "")
            msg |= {
                "tool_call_id": call_id,
                **({"name": m.tool_name or name} if (m.tool_name or name) else {}),
            }
        messages.append(msg)
    tools = parse_openai_tools(body.tools)
    return ChatRequest(
        messages,
        tools,
        ToolChoice("auto" if tools else "none"),
        response_schema=response_schema(body.format),
    )


def untagged(model: str) -> str:
    """Ollama's `name:latest` is the model `name`; other tags are part of the name."""
    return model[: -len(":latest")] if model.endswith(":latest") else model


def tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def ndjson(objs: AsyncIterator[dict]) -> StreamingResponse:
    """A stream of JSON lines; a failure after the first line becomes an `{"error": ...}` line, which Ollama's
    clients raise."""

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for obj in objs:
                yield (json.dumps(obj, ensure_ascii=False) + "\n").encode()
        except Exception as exc:  # noqa: BLE001 - reported in the stream, as Ollama does, and logged
            log.exception("generation failed mid-stream")
            message = exc.message if isinstance(exc, QuantserveError) else f"{type(exc).__name__}: {exc}"
            yield (json.dumps({"error": f"generation failed: {message}"}) + "\n").encode()

    return StreamingResponse(lines(), media_type=NDJSON)
