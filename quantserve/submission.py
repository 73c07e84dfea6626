"""One request for text, as the library and every API make it, and what submitting it gives back: its choices
running on the engine, their outputs interleaved as they arrive, and a chat's outputs read into reply events
(answer, reasoning, tool calls). `LLM.submit` turns the first into the second; the server only translates the wire
format into a TextRequest and the events back into the wire format."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quantserve.chat import ChatPrompt, ChatRequest, Event, Reply, ReplyAssembler, TextDelta
from quantserve.core.multimodal import Image
from quantserve.core.sequence import SequenceOutput, TokenLogprob
from quantserve.engine.async_engine import RequestStream
from quantserve.structured import Grammar


@dataclass(frozen=True)
class TextRequest:
    """A chat (`chat`) or a completion of `prompts` (text, or token ids), with what the caller sets of sampling.

    `sampling`: SamplingParams fields the request sets (None: unset, the model's default applies); `max_tokens`,
    the grammar and the thinking budget are the pipeline's to decide, so they are fields of their own. `context`:
    tokens that go before the prompt (Ollama's `context`, the previous turn's). `images`: a chat's, in the order of
    its `{"type": "image"}` parts."""

    chat: ChatRequest | None = None
    prompts: Sequence[str | Sequence[int]] = ()
    context: Sequence[int] = ()
    images: Sequence[Image] = ()
    max_tokens: int | None = None
    grammar: Grammar | None = None  # a completion's (a chat's comes from its prompt: tools, schema, its own)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    n: int = 1
    request_id: str = ""


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
    assembler: ReplyAssembler | None = None  # chats with tools or reasoning: text -> answer, reasoning, calls
    reply: Reply | None = None  # what the reply is, once finished

    def take(self, out: SequenceOutput) -> list[Event]:
        """Record one output and return the reply events it makes."""
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


@dataclass
class Submission:
    """A submitted request: its prompts as tokens, a chat's prompt, and its choices (n per prompt) running."""

    prompts: list[list[int]]
    chat: ChatPrompt | None
    gens: list[RequestStream]
    choices: list[Choice]

    async def outputs(self) -> AsyncIterator[tuple[Choice, SequenceOutput, list[Event]]]:
        """Every choice's outputs as they arrive, each recorded in its choice, with the reply events it makes.
        However the iteration ends (done, an error, the caller gone), every choice still running is aborted."""
        async for i, out in merge(self.gens):
            choice = self.choices[i]
            yield choice, out, choice.take(out)

    async def finish(self) -> list[Choice]:
        """Run every choice to its end."""
        async for _ in self.outputs():
            pass
        return self.choices

    def close(self) -> None:
        """Abort every choice still running."""
        for g in self.gens:
            g.close()


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
