"""Running requests on the engine for every API: n choices per prompt, their outputs interleaved as they arrive,
SSE framing, cancellation when the client goes away, and chats turned into reply events (text and tool calls)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantserve.chat import ChatPrompt, Event, Reply, ReplyAssembler, TextDelta
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import SequenceOutput, TokenLogprob
from quantserve.errors import QuantserveError
from quantserve.llm import LLM, RequestStream
from quantserve.server.state import ServerState

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


@dataclass
class Choice:
    """Accumulates one choice's outputs."""

    index: int
    prompt_index: int
    text: str = ""
    finish_reason: str | None = None
    stop: str | None = None  # the stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    assembler: ReplyAssembler | None = None  # chats with tools: text -> content and tool calls
    reply: Reply | None = None  # chats: what the reply is, once finished

    def take(self, out: SequenceOutput) -> list[Event]:
        """Record one output; for a chat, return the reply events it makes."""
        self.text += out.text
        self.num_output_tokens = out.num_output_tokens
        self.num_reasoning_tokens = out.num_reasoning_tokens
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if self.assembler is not None:
            events = self.assembler.feed(out.text)
        else:
            events = [TextDelta(out.text)] if out.text else []
        if out.finish_reason:
            self.finish_reason, self.stop = out.finish_reason, out.stop
            if self.assembler is not None:
                more, self.reply = self.assembler.finish(out.finish_reason)
                events += more
            else:
                self.reply = Reply(self.text, (), out.finish_reason)
        return events


async def merge(gens: list[RequestStream]) -> AsyncIterator[tuple[int, SequenceOutput]]:
    """Interleave several choices' outputs as they arrive. However this ends (done, error, the client gone), every
    choice still running is aborted."""
    try:
        if len(gens) == 1:
            async for out in gens[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: RequestStream) -> None:
            try:
                async for out in gen:
                    await q.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
                await q.put((i, exc))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for g in gens:
            g.close()


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
    """One text request on the engine: the model, the choices running, the prompts they continue."""

    state: ServerState
    request: Request
    llm: LLM
    gens: list[RequestStream]
    choices: list[Choice]
    prompts: list[list[int]]
    t0: float  # when the request began (time to first token, latency)
    on_first: Callable[[], None] | None = None  # also called at the first output (Ollama's timings)

    @classmethod
    def start(
        cls,
        state: ServerState,
        request: Request,
        llm: LLM,
        t0: float,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        rid: str,
        images=None,
        chat: ChatPrompt | None = None,
    ) -> Run:
        """Submit n choices per prompt; a chat's choices each get the prompt's reply parser (and a thinking
        model's, the engine's watch over its reasoning)."""
        if chat is not None and chat.reasoning is not None:
            params = replace(params, thinking=llm.thinking_spec(chat), skip_special_tokens=False)
        gens, choices = start(llm, prompts, params, n, rid, images)
        if chat is not None:
            for c in choices:
                c.assembler = chat.assembler()
        return cls(state, request, llm, gens, choices, prompts, t0)

    async def respond(self, encoder: Encoder, stream: bool):
        """Every text route's end: stream the choices through `encoder` as SSE, or run them to their end and
        return its response (a client that leaves first gets a 499 nobody reads). Metrics are recorded once the
        choices finish."""
        if stream:
            return event_stream(self._chunks(encoder), encoder.error, encoder.media_type)
        if not await until_disconnect(self.request, collect(self.gens, self.choices, self._first)):
            return JSONResponse({}, status_code=499)
        self._record()
        return encoder.response()

    async def _chunks(self, encoder: Encoder) -> AsyncIterator[bytes]:
        for chunk in encoder.opening():
            yield chunk
        first = True
        async for i, out in merge(self.gens):
            if first:
                self._first()
                first = False
            choice = self.choices[i]
            for chunk in encoder.take(choice, out, choice.take(out)):
                yield chunk
        self._record()
        for chunk in encoder.closing():
            yield chunk

    def _first(self) -> None:
        self.state.observe_ttft(self.llm, self.t0)
        if self.on_first is not None:
            self.on_first()

    def _record(self) -> None:
        self.state.record(self.llm, self.choices, self.prompts, self.t0)


def start(llm: LLM, prompts: list[list[int]], base: SamplingParams, n: int, rid: str, images=None):
    """Submit n choices per prompt. Seeds differ per choice (seed + i) so choices are not identical. `images`:
    the ImageSpans of a single prompt (a chat's)."""
    gens, choices = [], []
    try:
        for p_idx, tokens in enumerate(prompts):
            for j in range(n):
                params = base
                if n > 1 and base.seed is not None:
                    params = SamplingParams(**{**base.__dict__, "seed": base.seed + j})
                gens.append(llm.generate(tokens, params, f"{rid}-{p_idx}-{j}", images))
                choices.append(Choice(index=len(choices), prompt_index=p_idx, num_prompt_tokens=len(tokens)))
    except BaseException:
        for g in gens:
            g.close()  # a later choice was refused (queue full): abort the ones already queued
        raise
    return gens, choices


async def collect(gens: list[RequestStream], choices: list[Choice], on_first: Callable[[], None]) -> None:
    """Run every choice to its end (non-streaming responses)."""
    first = True
    async for i, out in merge(gens):
        if first:
            on_first()
            first = False
        choices[i].take(out)


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
