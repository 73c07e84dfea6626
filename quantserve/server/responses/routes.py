"""/v1/responses: the Responses API translated onto the chat path (llama-server does the same), streamed with the
event sequence the official client consumes, and kept in a bounded store for previous_response_id."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from quantserve.chat import ChatRequest, Event, ReasoningDelta, TextDelta
from quantserve.core.multimodal import Image
from quantserve.server.errors import error_body
from quantserve.server.generation import Run, sse
from quantserve.server.responses.protocol import (
    ResponsesRequest,
    call_item,
    echo_choice,
    echo_tools,
    input_messages,
    message_item,
    messages_of,
    output_items,
    reasoning_item,
    response_tools,
    tool_choice,
)
from quantserve.server.responses.store import ResponseStore, StoredResponse
from quantserve.server.state import ServerState
from quantserve.submission import Choice, TextRequest

router = APIRouter()


def _usage(c: Choice) -> dict[str, Any]:
    return {
        "input_tokens": c.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": c.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": c.num_reasoning_tokens},
        "total_tokens": c.num_prompt_tokens + c.num_output_tokens,
    }


def _finished(base: dict[str, Any], c: Choice, output: list[dict[str, Any]]) -> dict[str, Any]:
    assert c.reply is not None
    cut = c.reply.finish_reason == "length"
    return {
        **base,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": [{**item, "status": "incomplete"} for item in output] if cut else output,
        "usage": _usage(c),
    }


class _Events:
    """The Responses stream: output items opened and closed around text and tool-call deltas, numbered events."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.open: dict[str, Any] | None = None  # the item being written

    def ev(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, event=kind)

    def take(self, event: Event) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self.open is None or self.open["type"] != "reasoning":
                out += self.close()
                self.open = reasoning_item("", status="in_progress")
                out.append(
                    self.ev("response.output_item.added", output_index=len(self.items), item=self.open)
                )
            self.open["content"][0]["text"] += event.text
            out.append(self._part("response.reasoning_text.delta", None, delta=event.text))
        elif isinstance(event, TextDelta):
            if self.open is None or self.open["type"] != "message":
                out += self.close()
                self.open = message_item("", status="in_progress")
                out.append(
                    self.ev("response.output_item.added", output_index=len(self.items), item=self.open)
                )
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self._part("response.content_part.added", part))
                self.open["content"] = [part]
            self.open["content"][0]["text"] += event.text
            out.append(self._part("response.output_text.delta", None, delta=event.text, logprobs=[]))
        elif event.name is not None:  # a new call
            out += self.close()
            self.open = call_item(event.id or "", event.name, event.arguments, status="in_progress")
            out.append(
                self.ev("response.output_item.added", output_index=len(self.items), item={**self.open})
            )
        else:
            assert self.open is not None and self.open["type"] == "function_call"
            self.open["arguments"] += event.arguments
            out.append(
                self.ev(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items),
                    delta=event.arguments,
                )
            )
        return out

    def _part(self, kind: str, part: dict | None, **fields: Any) -> bytes:
        assert self.open is not None
        where = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        return self.ev(kind, **where, **({"part": part} if part is not None else {}), **fields)

    def close(self) -> list[bytes]:
        item, out = self.open, []
        if item is None:
            return out
        index = len(self.items)
        item["status"] = "completed"
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self._part("response.reasoning_text.done", None, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self._part("response.output_text.done", None, text=part["text"], logprobs=[]))
            out.append(self._part("response.content_part.done", part))
        else:
            out.append(
                self.ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self.ev("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self.open = None
        return out


class _ResponseEncoder:
    """A response and its events: created and in_progress, output items around the reply's events, then
    completed or incomplete; the finished response is stored for previous_response_id (`keep`)."""

    media_type = "text/event-stream"

    def __init__(self, run: Run, base: dict[str, Any], keep: Callable[[dict, list], None]):
        self.choice, self.base, self.keep = run.choices[0], base, keep
        self.events = _Events()

    def opening(self) -> list[bytes]:
        return [
            self.events.ev(kind, response=self.base) for kind in ("response.created", "response.in_progress")
        ]

    def take(self, choice: Choice, out, events) -> list[bytes]:
        return [chunk for event in events for chunk in self.events.take(event)]

    def closing(self) -> list[bytes]:
        out = self.events.close()
        done = _finished(self.base, self.choice, self.events.items)
        self.keep(done, self.events.items)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return [*out, self.events.ev(kind, response=done)]

    def response(self) -> dict:
        assert self.choice.reply is not None
        output = output_items(self.choice.reply)
        done = _finished(self.base, self.choice, output)
        self.keep(done, output)
        return done

    def error(self, message: str) -> list[bytes]:
        fields = {k: v for k, v in error_body(message, "server_error")["error"].items() if k != "type"}
        return [self.events.ev("error", **fields)]


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state: ServerState = request.app.state.qs
    store: ResponseStore = request.app.state.responses
    llm = await state.acquire(request, body.model)
    t0 = time.perf_counter()
    history: list[dict[str, Any]] = []
    history_images: tuple[Image, ...] = ()
    if body.previous_response_id:
        previous = store.get(body.previous_response_id, param="previous_response_id")
        history, history_images = list(previous.messages), previous.images
    reader = state.reader(llm)
    messages = [*history, *input_messages(body.input, reader)]
    tools = response_tools(body.tools)
    choice = tool_choice(body.tool_choice, tools)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    effort = (body.reasoning or {}).get("effort")
    req = ChatRequest(
        messages=system + messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_schema=body.response_schema(),
        reasoning=llm.reasoning_request(effort=effort, effort_param="reasoning.effort"),
    )
    images = [*history_images, *await reader.load(state.media)]
    rid = f"resp_{uuid.uuid4().hex}"
    sampling = dict(temperature=body.temperature, top_p=body.top_p)
    submission = llm.submit(
        TextRequest(
            chat=req, images=images, max_tokens=body.max_output_tokens, sampling=sampling, request_id=rid
        )
    )
    run = Run(state, request, llm, submission, t0)
    base = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": llm.name,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        if body.text and body.text.format
        else {"format": {"type": "text"}},
        "tool_choice": echo_choice(choice),
        "tools": echo_tools(tools),
        "truncation": "disabled",
        "usage": None,
        "metadata": body.metadata or {},
        "user": body.user,
    }

    def keep(response: dict[str, Any], output: list[dict[str, Any]]) -> None:
        if body.store:
            store.put(rid, StoredResponse(response, tuple(messages + messages_of(output)), tuple(images)))

    return await run.respond(_ResponseEncoder(run, base, keep), body.stream)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return request.app.state.responses.get(response_id).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    request.app.state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
