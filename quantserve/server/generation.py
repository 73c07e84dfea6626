"""Answering a submitted request for every API: SSE framing, the whole response or the stream through the API's
encoder, cancellation when the client goes away, and the metrics. What runs is LLM.submit's (quantserve.submission)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantserve.chat import Event
from quantserve.core.sequence import SequenceOutput
from quantserve.errors import QuantserveError
from quantserve.llm import LLM
from quantserve.server.state import ServerState
from quantserve.submission import Choice, Submission

log = logging.getLogger("quantserve.server")


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {dumps(obj)}\n\n".encode()


def event_stream(
    chunks: AsyncIterator[bytes],
    on_error: Callable[[str], list[bytes]],
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """A streamed response (SSE, or Ollama's JSON lines). Once a stream has started its status is sent; an engine
    failure then becomes the API's own error event (`on_error(message)`), instead of a connection cut without
    explanation."""

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - reported to the client, and logged
            log.exception("generation failed mid-stream")
            message = exc.message if isinstance(exc, QuantserveError) else f"{type(exc).__name__}: {exc}"
            for chunk in on_error(f"generation failed: {message}"):
                yield chunk

    return StreamingResponse(guarded(), media_type=media_type, headers={"Cache-Control": "no-cache"})


class Encoder(Protocol):
    """One API's shape of a text request: its stream as chunks (opened, each output's reply events, closed), its
    whole response, and its error event."""

    media_type: str  # of the stream: "text/event-stream", or Ollama's "application/x-ndjson"

    def opening(self) -> list[bytes]:
        """The chunks before the first output."""
        ...

    def take(self, choice: Choice, out: SequenceOutput, events: list[Event]) -> list[bytes]:
        """The chunks of one output of `choice`, already recorded there (`events`: its reply events)."""
        ...

    def closing(self) -> list[bytes]:
        """The chunks after the last output."""
        ...

    def response(self) -> dict:
        """The whole response, once every choice has finished (non-streamed requests)."""
        ...

    def error(self, message: str) -> list[bytes]:
        """The API's error event for a failure after the stream has started."""
        ...


@dataclass
class Run:
    """One text request on the engine, as a route answers it: the model, its submission, the clock."""

    state: ServerState
    request: Request
    llm: LLM
    submission: Submission
    t0: float  # when the request began (time to first token, latency)
    on_first: Callable[[], None] | None = None  # also called at the first output (Ollama's timings)

    @property
    def choices(self) -> list[Choice]:
        return self.submission.choices

    @property
    def prompts(self) -> list[list[int]]:
        return self.submission.prompts

    async def respond(self, encoder: Encoder, stream: bool):
        """Every text route's end: stream the choices through `encoder` as SSE, or run them to their end and
        return its response (a client that leaves first gets a 499 nobody reads). Metrics are recorded once the
        choices finish."""
        if stream:
            return event_stream(self._chunks(encoder), encoder.error, encoder.media_type)
        if not await until_disconnect(self.request, self._collect()):
            return JSONResponse({}, status_code=499)
        self._record()
        return encoder.response()

    async def _chunks(self, encoder: Encoder) -> AsyncIterator[bytes]:
        for chunk in encoder.opening():
            yield chunk
        first = True
        async for choice, out, events in self.submission.outputs():
            if first:
                self._first()
                first = False
            for chunk in encoder.take(choice, out, events):
                yield chunk
        self._record()
        for chunk in encoder.closing():
            yield chunk

    async def _collect(self) -> None:
        first = True
        async for _ in self.submission.outputs():
            if first:
                self._first()
                first = False

    def _first(self) -> None:
        self.state.observe_ttft(self.llm, self.t0)
        if self.on_first is not None:
            self.on_first()

    def _record(self) -> None:
        self.state.record(self.llm, self.choices, self.prompts, self.t0)


async def until_disconnect(request: Request, coro) -> bool:
    """Run a non-streaming generation, cancelling it (and so aborting its sequences) if the client goes away.
    Returns whether it ran to its end (False: the client left)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        return False
    task.result()  # an engine failure is raised here
    return True


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(c.num_output_tokens for c in choices)
    out: dict = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    reasoning = sum(c.num_reasoning_tokens for c in choices)
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out
