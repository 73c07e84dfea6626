"""Ollama's native API on the same server and router as the OpenAI and Anthropic ones (docs/api.md of the ollama
repository), its generation routes: /api/chat, generate, embed and embeddings (the model routes are in models.py).
Streams are NDJSON, durations nanoseconds, and errors Ollama's `{"error": "..."}` (server/errors.py). Model names
may carry Ollama's `:latest` tag.

keep_alive works as in Ollama: 0 unloads the model once the request is done, a duration sets how long it stays
loaded while idle, a negative one keeps it. A single-model server reloads its model on the next request after
such an unload.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from quantserve.chat import ChatRequest, ReasoningDelta, TextDelta
from quantserve.chat.reasoning_request import ReasoningRequest
from quantserve.errors import InvalidRequestError
from quantserve.llm import LLM
from quantserve.server.generation import Run
from quantserve.server.ollama.protocol import (
    NDJSON,
    ChatBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    KeepAlive,
    Options,
    chat_request,
    image_part,
    keep_alive_seconds,
    response_schema,
    tagged,
    untagged,
)
from quantserve.server.served import Served
from quantserve.server.state import ServerState
from quantserve.structured.grammars import json_schema_grammar
from quantserve.submission import Choice, Submission, TextRequest

log = logging.getLogger("quantserve.server")
router = APIRouter()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(1, int(seconds * 1e9))


class Clock:
    """The final object's timing fields, from real timestamps: load (finding or loading the model), prompt
    evaluation (until the first token), generation (from it to the last)."""

    def __init__(self) -> None:
        self.start = self.loaded = self.first = time.perf_counter()

    def mark_loaded(self) -> None:
        self.loaded = self.first = time.perf_counter()

    def mark_first(self) -> None:
        self.first = time.perf_counter()

    def fields(self, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
        end = time.perf_counter()
        return {
            "total_duration": _ns(end - self.start),
            "load_duration": _ns(self.loaded - self.start),
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": _ns(self.first - self.loaded),
            "eval_count": output_tokens,
            "eval_duration": _ns(end - self.first),
        }


async def _acquire(request: Request, model: str, keep_alive: KeepAlive) -> tuple[LLM, Served, Clock]:
    """The model, loaded and leased for this request; a keep_alive duration is applied now, a zero one once
    the request is done (_unload_after)."""
    state: ServerState = request.app.state.qs
    clock = Clock()
    seconds = keep_alive_seconds(keep_alive)
    served = state.router.find(untagged(model))
    llm = await state.acquire(request, untagged(model))
    clock.mark_loaded()
    if keep_alive is not None and seconds != 0:
        state.router.set_keep_alive(served, seconds)
    return llm, served, clock


def _unload_after(state: ServerState, served: Served, keep_alive: KeepAlive) -> bool:
    """keep_alive 0: the model unloads once this request's lease is given back. Returns whether it will."""
    if keep_alive is None or keep_alive_seconds(keep_alive) != 0:
        return False
    return state.router.unload_on_request(served, "keep_alive=0")


def _submit(llm: LLM, options: Options | None, **request) -> Submission:
    """`request` (TextRequest's fields) with the request's `options` as its sampling."""
    options = options or Options()
    return llm.submit(
        TextRequest(max_tokens=options.max_tokens, sampling=options.sampling(), request_id=_rid(), **request)
    )


def _check_think(llm: LLM, think) -> None:
    if think not in (None, False):
        raise InvalidRequestError(f"{tagged(llm.name)!r} does not support thinking", param="think")


def _reasoning(llm: LLM, think) -> ReasoningRequest:
    """Ollama's `think`: true or false switches thinking, "low"/"medium"/"high" sets gpt-oss's effort."""
    if think in ("low", "medium", "high"):
        return llm.reasoning_request(enable=True, effort=think, asked="think")
    return llm.reasoning_request(enable=think, asked="think" if think else None)


def _tool_calls(c: Choice) -> list[dict[str, Any]]:
    assert c.reply is not None
    return [{"function": {"name": t.name, "arguments": json.loads(t.arguments)}} for t in c.reply.tool_calls]


def _done_reason(c: Choice) -> str:
    reason = c.reply.finish_reason if c.reply is not None else c.finish_reason
    return "length" if reason == "length" else "stop"


def _load_only(request: Request, body, served: Served, kind: str) -> dict[str, Any]:
    """An empty chat or prompt: load the model (and with keep_alive 0, unload it)."""
    unload = _unload_after(request.app.state.qs, served, body.keep_alive)
    out: dict[str, Any] = {"model": tagged(untagged(body.model)), "created_at": _now()}
    out |= {"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""}
    return {**out, "done_reason": "unload" if unload else "load", "done": True}


def _rid() -> str:
    return f"ollama-{uuid.uuid4().hex}"


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


class _Encoder:
    """Ollama's JSON lines: a line per output with text, then the final line with the timings; its final object
    unloads the model after it if keep_alive says so."""

    media_type = NDJSON

    def __init__(self, run: Run, body: ChatBody | GenerateBody, served: Served, clock: Clock):
        self.run, self.choice, self.body, self.served, self.clock = run, run.choices[0], body, served, clock
        self.head = {"model": tagged(untagged(body.model))}

    def final(self) -> dict[str, Any]:
        _unload_after(self.run.state, self.served, self.body.keep_alive)
        c = self.choice
        stats = self.clock.fields(c.num_prompt_tokens, c.num_output_tokens)
        return {**self.head, "created_at": _now(), "done": True, "done_reason": _done_reason(c), **stats}

    def opening(self) -> list[bytes]:
        return []

    def error(self, message: str) -> list[bytes]:
        return [_line({"error": message})]


class _ChatEncoder(_Encoder):
    def take(self, choice: Choice, out, events) -> list[bytes]:
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        message = {"role": "assistant", "content": text}
        if thought:
            message["thinking"] = thought
        line = {**self.head, "created_at": _now(), "message": message, "done": False}
        return [_line(line)] if text or thought else []

    def closing(self) -> list[bytes]:
        out = []
        if self.choice.reply is not None and self.choice.reply.tool_calls:
            message = {"role": "assistant", "content": "", "tool_calls": _tool_calls(self.choice)}
            out.append(_line({**self.head, "created_at": _now(), "message": message, "done": False}))
        return [*out, _line({**self.final(), "message": {"role": "assistant", "content": ""}})]

    def response(self) -> dict:
        reply = self.choice.reply
        assert reply is not None
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
        if reply.reasoning:
            message["thinking"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = _tool_calls(self.choice)
        return {**self.final(), "message": message}


class _GenerateEncoder(_Encoder):
    def final(self) -> dict[str, Any]:
        out = super().final()
        if not self.body.raw:  # the tokens to send back as `context` for the next turn
            tokens, text = self.run.prompts[0], self.choice.text
            out["context"] = tokens + self.run.llm.tokenize_prompt(text, chat=False) if text else tokens
        return out

    def take(self, choice: Choice, out, events) -> list[bytes]:
        line = {**self.head, "created_at": _now(), "response": out.text, "done": False}
        return [_line(line)] if out.text else []

    def closing(self) -> list[bytes]:
        return [_line({**self.final(), "response": ""})]

    def response(self) -> dict:
        return {**self.final(), "response": self.choice.text}


@router.post("/api/chat")
async def chat(body: ChatBody, request: Request):
    state: ServerState = request.app.state.qs
    llm, served, clock = await _acquire(request, body.model, body.keep_alive)
    if not body.messages:
        return _load_only(request, body, served, "chat")
    reader = state.reader(llm)
    req = replace(chat_request(body, reader), reasoning=_reasoning(llm, body.think))
    submission = _submit(llm, body.options, chat=req, images=await reader.load(state.media))
    run = Run(state, request, llm, submission, clock.start, on_first=clock.mark_first)
    return await run.respond(_ChatEncoder(run, body, served, clock), body.stream)


@router.post("/api/generate")
async def generate(body: GenerateBody, request: Request):
    state: ServerState = request.app.state.qs
    llm, served, clock = await _acquire(request, body.model, body.keep_alive)
    if not body.prompt and not body.images:
        return _load_only(request, body, served, "generate")
    _check_think(llm, body.think)
    if body.suffix:
        raise InvalidRequestError(
            f"{tagged(llm.name)!r} does not support insert (suffix): it has no fill-in-the-middle template",
            param="suffix",
        )
    if body.template:
        raise InvalidRequestError(
            "'template' (a Go template) is not supported; send raw: true with the prompt already formatted",
            param="template",
        )
    context = list(body.context or ())
    if body.raw or llm.chat_template is None:
        if body.images:
            raise InvalidRequestError(
                "'images' need the model's chat template (raw is false)", param="images"
            )
        schema = response_schema(body.format) if body.raw and body.format else None
        grammar = json_schema_grammar(schema, param="format") if schema is not None else None
        submission = _submit(llm, body.options, prompts=[body.prompt or ""], context=context, grammar=grammar)
    else:
        reader = state.reader(llm)
        parts = [image_part(b, f"images[{j}]", reader) for j, b in enumerate(body.images or [])]
        content: Any = [*parts, {"type": "text", "text": body.prompt or ""}] if parts else body.prompt or ""
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": content}
        ]
        req = ChatRequest(messages, response_schema=response_schema(body.format))
        submission = _submit(
            llm, body.options, chat=req, images=await reader.load(state.media), context=context
        )
    run = Run(state, request, llm, submission, clock.start, on_first=clock.mark_first)
    return await run.respond(_GenerateEncoder(run, body, served, clock), body.stream)


@router.post("/api/embed")
async def embed(body: EmbedBody, request: Request):
    llm, served, clock = await _acquire(request, body.model, body.keep_alive)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or any(not t for t in texts):
        raise InvalidRequestError("'input' must hold text", param="input")
    vectors, n = [], 0
    for text in texts:
        tokens = llm.tokenize_prompt(text, chat=False)
        if len(tokens) > llm.n_ctx:
            if not body.truncate:
                raise InvalidRequestError(
                    f"the input has {len(tokens)} tokens, over the context of {llm.n_ctx}; send truncate: true",
                    param="input",
                )
            tokens = tokens[: llm.n_ctx]
        n += len(tokens)
        vec = np.asarray(await llm.embed(tokens), dtype=np.float64)
        norm = float(np.linalg.norm(vec))
        vectors.append((vec / norm if norm > 0 else vec).tolist())  # /api/embed's vectors are unit length
    if body.dimensions is not None:
        raise InvalidRequestError("'dimensions' is not supported by this model", param="dimensions")
    _unload_after(request.app.state.qs, served, body.keep_alive)
    stats = clock.fields(n, 0)
    return {"model": tagged(untagged(body.model)), "embeddings": vectors, "total_duration": stats["total_duration"],
            "load_duration": stats["load_duration"], "prompt_eval_count": n}  # fmt: skip


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsBody, request: Request):
    llm, served, _ = await _acquire(request, body.model, body.keep_alive)
    if not body.prompt:
        return {"embedding": []}
    vec = await llm.embed(llm.tokenize_prompt(body.prompt, chat=False)[: llm.n_ctx])
    _unload_after(request.app.state.qs, served, body.keep_alive)
    return {"embedding": list(vec)}
