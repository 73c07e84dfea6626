"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API translated onto the chat path, streamed
with Anthropic's events; errors on these routes use Anthropic's error shape (server/errors.py)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from quantserve.chat import ChatRequest, Event, ReasoningDelta, Reply, TextDelta
from quantserve.chat.jsonscan import no_lone_surrogates
from quantserve.core.multimodal import Image
from quantserve.llm import LLM
from quantserve.server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_tool_choice,
    anthropic_tools,
    chat_messages,
    system_text,
)
from quantserve.server.errors import anthropic_error_body
from quantserve.server.generation import Run, sse
from quantserve.server.state import ServerState
from quantserve.submission import Choice, TextRequest

router = APIRouter()


async def _chat_request(
    body: MessagesRequest | CountTokensRequest, llm: LLM, state: ServerState
) -> tuple[ChatRequest, list[Image]]:
    """The request as the library's ChatRequest, and its images fetched and decoded."""
    reader = state.reader(llm)
    tools = anthropic_tools(body.tools)
    choice, parallel = anthropic_tool_choice(body.tool_choice, tools)
    system = system_text(body.system, reader)
    messages = chat_messages(body.messages, reader)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    schema = body.response_schema() if isinstance(body, MessagesRequest) else None
    # a final assistant message is a prefill: the reply continues it (Anthropic's API works that way)
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    enable, budget = body.thinking_controls() if isinstance(body, MessagesRequest) else (None, None)
    reasoning = llm.reasoning_request(
        enable=enable,
        budget=budget,
        asked="thinking" if enable else None,
        budget_param="thinking.budget_tokens",
    )
    req = ChatRequest(
        messages, tools, choice, parallel, response_schema=schema, continue_final=prefill, reasoning=reasoning
    )
    return req, await reader.load(state.media)


def _stop(c: Choice) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence."""
    reply = c.reply
    assert reply is not None
    if reply.tool_calls and reply.finish_reason == "tool_calls":
        return "tool_use", None
    if reply.finish_reason == "length":
        return "max_tokens", None
    return ("stop_sequence", c.stop) if c.stop else ("end_turn", None)


def _input(arguments: str) -> Any:
    """A call's arguments (checked JSON) as the `input` object, strings made safe for UTF-8."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return no_lone_surrogates(value)
        if isinstance(value, dict):
            return {clean(k): clean(v) for k, v in value.items()}
        return [clean(v) for v in value] if isinstance(value, list) else value

    return clean(json.loads(arguments))


# Anthropic's clients require a signature on every thinking block, and send it back with the block. Ours signs
# nothing: reasoning comes back as the text it is, and the template keeps what its family keeps.
SIGNATURE = "quantserve"


def _content(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": SIGNATURE})
    if reply.content or not (blocks or reply.tool_calls):  # never no block: clients read content[0]
        blocks.append({"type": "text", "text": reply.content or ""})
    return blocks + [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
        for c in reply.tool_calls
    ]


def _usage(c: Choice) -> dict[str, int]:
    return {
        "input_tokens": c.num_prompt_tokens,
        "output_tokens": c.num_output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


class _Blocks:
    """Anthropic's stream: content blocks opened and closed around text and tool-call deltas, in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"

    def take(self, event: Event) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
            delta = {"type": "thinking_delta", "thinking": event.text}
        elif isinstance(event, TextDelta):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""}, "text")
            delta = {"type": "text_delta", "text": event.text}
        else:
            if event.name is not None:
                out += self._start(
                    {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}, "tool_use"
                )
            if not event.arguments:
                return out
            delta = {"type": "input_json_delta", "partial_json": event.arguments}
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return [*out, sse(data, event="content_block_delta")]

    def _start(self, block: dict[str, Any], kind: str) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        data = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, sse(data, event="content_block_start")]

    def at_least_one(self) -> list[bytes]:
        """An empty text block when no block was sent, as the whole message has one (clients read content[0])."""
        return self._start({"type": "text", "text": ""}, "text") if self.index < 0 else []

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        if self.open == "thinking":
            signed = {"type": "content_block_delta", "index": self.index}
            signed["delta"] = {"type": "signature_delta", "signature": SIGNATURE}
            out = [sse(signed, event="content_block_delta")]
        else:
            out = []
        self.open = None
        return [*out, sse({"type": "content_block_stop", "index": self.index}, event="content_block_stop")]


class _MessageEncoder:
    """A message and its events: message_start and a ping, content blocks around the reply's events,
    message_delta with the stop reason, message_stop."""

    media_type = "text/event-stream"

    def __init__(self, run: Run, mid: str):
        self.run, self.choice = run, run.choices[0]
        self.base = {"id": mid, "type": "message", "role": "assistant", "model": run.llm.name}
        self.blocks = _Blocks()

    def opening(self) -> list[bytes]:
        c = self.choice
        start = {**self.base, "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(c)}
        return [
            sse({"type": "message_start", "message": start}, event="message_start"),
            sse({"type": "ping"}, event="ping"),
        ]

    def take(self, choice: Choice, out, events) -> list[bytes]:
        return [chunk for event in events for chunk in self.blocks.take(event)]

    def closing(self) -> list[bytes]:
        reason, seq = _stop(self.choice)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}}
        return [
            *self.blocks.at_least_one(),
            *self.blocks.close(),
            sse({**delta, "usage": {"output_tokens": self.choice.num_output_tokens}}, event="message_delta"),
            sse({"type": "message_stop"}, event="message_stop"),
        ]

    def response(self) -> dict:
        c = self.choice
        reason, seq = _stop(c)
        assert c.reply is not None
        return {
            **self.base,
            "content": _content(c.reply),
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": _usage(c),
        }

    def error(self, message: str) -> list[bytes]:
        return [sse(anthropic_error_body(message, "api_error"), event="error")]


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state: ServerState = request.app.state.qs
    llm = await state.acquire(request, body.model)
    t0 = time.perf_counter()
    chat, images = await _chat_request(body, llm, state)
    mid = f"msg_{uuid.uuid4().hex}"
    sampling = dict(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
    )
    submission = llm.submit(
        TextRequest(chat=chat, images=images, max_tokens=body.max_tokens, sampling=sampling, request_id=mid)
    )
    run = Run(state, request, llm, submission, t0)
    return await run.respond(_MessageEncoder(run, mid), body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    state: ServerState = request.app.state.qs
    llm = await state.acquire(request, body.model)
    _, tokens, _ = llm.prepare_chat(*await _chat_request(body, llm, state))
    return {"input_tokens": len(tokens)}
