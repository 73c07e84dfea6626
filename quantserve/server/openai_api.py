"""/v1/chat/completions and /v1/completions: requests → sequences → OpenAI responses or SSE streams."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantserve.engine.async_engine import RequestStream
from quantserve.engine.sampling_params import SamplingParams
from quantserve.engine.sequence import SequenceOutput
from quantserve.errors import InvalidRequestError, QuantserveError
from quantserve.llm import LLM
from quantserve.server.errors import error_body
from quantserve.server.protocol import ChatCompletionRequest, CompletionRequest, response_format_grammar
from quantserve.server.state import ServerState
from quantserve.structured import Grammar

router = APIRouter()
log = logging.getLogger("quantserve.server")


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


@dataclass
class _Choice:
    """Accumulates one choice's outputs."""

    index: int
    prompt_index: int
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


async def _merge(gens: list[RequestStream]) -> AsyncIterator[tuple[int, SequenceOutput]]:
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


def _start(llm: LLM, prompts: list[list[int]], base: SamplingParams, n: int, rid: str):
    """Submit n choices per prompt. Seeds differ per choice (seed + i) so choices are not identical."""
    gens, choices = [], []
    try:
        for p_idx, tokens in enumerate(prompts):
            for j in range(n):
                params = base
                if n > 1 and base.seed is not None:
                    params = SamplingParams(**{**base.__dict__, "seed": base.seed + j})
                gens.append(llm.generate(tokens, params, f"{rid}-{p_idx}-{j}"))
                choices.append(_Choice(index=len(choices), prompt_index=p_idx, num_prompt_tokens=len(tokens)))
    except BaseException:
        for g in gens:
            g.close()  # a later choice was refused (queue full): abort the ones already queued
        raise
    return gens, choices


async def _errors_as_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Once a stream has started its status is sent; an engine failure then becomes an OpenAI error object in the
    stream, followed by [DONE], instead of a connection cut without explanation."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - reported to the client, and logged
        log.exception("generation failed mid-stream")
        message = exc.message if isinstance(exc, QuantserveError) else f"{type(exc).__name__}: {exc}"
        yield _sse(error_body(f"generation failed: {message}", "server_error"))
        yield b"data: [DONE]\n\n"


def _usage(choices: list[_Choice], prompts: list[list[int]]) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _until_disconnect(request: Request, coro):
    """Run a non-streaming generation, cancelling it (and so aborting its sequences) if the client goes away."""
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
        return None
    return task.result()


async def _collect(state: ServerState, gens, choices: list[_Choice], t0: float) -> dict[int, list]:
    """Gather every choice's text for a non-streaming response; returns the logprobs per choice."""
    lps: dict[int, list] = {c.index: [] for c in choices}
    first = True
    async for i, out in _merge(gens):
        if first:
            state.metrics.ttft.observe(time.perf_counter() - t0)
            first = False
        c = choices[i]
        c.text += out.text
        c.num_output_tokens = out.num_output_tokens
        c.finish_reason = out.finish_reason or c.finish_reason
        if out.logprobs:
            lps[i].extend(out.logprobs)
    return lps


def _params(llm: LLM, req, *, max_tokens: int, grammar: Grammar | None, logprobs: bool, top_logprobs: int):
    bias = None
    if req.logit_bias:
        try:
            bias = tuple((int(k), float(v)) for k, v in req.logit_bias.items())
        except ValueError as exc:
            raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from exc
    return llm.sampling_params(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repeat_penalty=req.repeat_penalty or req.repetition_penalty,
        seed=req.seed,
        stop=tuple(req.stop or ()),
        logprobs=logprobs or None,
        top_logprobs=top_logprobs or None,
        grammar=grammar,
        logit_bias=bias,
        ignore_eos=req.ignore_eos or None,
    )


# ---- chat --------------------------------------------------------------------------------------


def _chat_logprobs(llm: LLM, lps) -> list[dict]:
    def entry(tok: int, lp: float) -> dict:
        text = llm.token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(llm.runner.token_bytes(tok))}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state: ServerState = request.app.state.qs
    llm = state.require_model(body.model)
    t0 = time.perf_counter()
    extra = dict(body.chat_template_kwargs or {})
    if body.tools:
        extra["tools"] = body.tools
    prompt_text = llm.render_chat([m.for_template() for m in body.messages], **extra)
    tokens = llm.tokenize_prompt(prompt_text, chat=True)
    max_tokens = llm.check_context(len(tokens), body.max_completion_tokens or body.max_tokens)
    params = _params(
        llm,
        body,
        max_tokens=max_tokens,
        grammar=response_format_grammar(body.response_format),
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gens, choices = _start(llm, [tokens], params, body.n, rid)
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": llm.name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            extra_fields = {"usage": None} if include_usage else {}
            for c in choices:
                first = {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse({**base, "choices": [first], **extra_fields})
            first_token = True
            async for i, out in _merge(gens):
                c = choices[i]
                if first_token:
                    state.metrics.ttft.observe(time.perf_counter() - t0)
                    first_token = False
                c.num_output_tokens = out.num_output_tokens
                delta = {"content": out.text} if out.text else {}
                lp = {"content": _chat_logprobs(llm, out.logprobs)} if out.logprobs else None
                if out.text or lp:
                    ch = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}
                    yield _sse({**base, "choices": [ch], **extra_fields})
                if out.finish_reason:
                    ch = {"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason}
                    yield _sse({**base, "choices": [ch], **extra_fields})
            state.record(choices, [tokens], t0)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(choices, [tokens])})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            _errors_as_events(stream()), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    all_lps = await _until_disconnect(request, _collect(state, gens, choices, t0))
    if all_lps is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    state.record(choices, [tokens], t0)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": llm.name,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": _chat_logprobs(llm, all_lps[c.index])} if body.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": _usage(choices, [tokens]),
    }


# ---- completions -------------------------------------------------------------------------------


def _prompts(llm: LLM, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [llm.tokenize_prompt(prompt, chat=False)]
    if not prompt:
        raise InvalidRequestError("'prompt' is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    out = []
    for p in prompt:
        out.append(llm.tokenize_prompt(p, chat=False) if isinstance(p, str) else list(p))
    for toks in out:
        if any(not 0 <= t < llm.runner.n_vocab for t in toks):
            raise InvalidRequestError(
                f"'prompt' has token ids outside 0..{llm.runner.n_vocab - 1}", param="prompt"
            )
    return out


def _completion_logprobs(llm: LLM, lps, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text = llm.token_text(lp.token)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({llm.token_text(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state: ServerState = request.app.state.qs
    llm = state.require_model(body.model)
    if body.suffix:
        raise InvalidRequestError("'suffix' (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise InvalidRequestError("'best_of' is not supported (only best_of == n)", param="best_of")
    t0 = time.perf_counter()
    prompts = _prompts(llm, body.prompt)
    max_tokens = min(llm.check_context(len(p), body.max_tokens) for p in prompts)
    want_lp = body.logprobs is not None
    params = _params(
        llm, body, max_tokens=max_tokens, grammar=None, logprobs=want_lp, top_logprobs=body.logprobs or 0
    )
    rid = f"cmpl-{uuid.uuid4().hex}"
    gens, choices = _start(llm, prompts, params, body.n, rid)
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": llm.name}
    if isinstance(body.prompt, str):
        echo_text = {0: body.prompt}
    else:
        echo_text = {i: llm.detokenize(p) for i, p in enumerate(prompts)} if body.echo else {}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            extra_fields = {"usage": None} if include_usage else {}
            if body.echo:
                for c in choices:
                    ch = {
                        "index": c.index,
                        "text": echo_text[c.prompt_index],
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _sse({**base, "choices": [ch], **extra_fields})
            first = True
            offsets = {c.index: 0 for c in choices}
            async for i, out in _merge(gens):
                if first:
                    state.metrics.ttft.observe(time.perf_counter() - t0)
                    first = False
                choices[i].num_output_tokens = out.num_output_tokens
                lp = _completion_logprobs(llm, out.logprobs, offsets[i]) if out.logprobs else None
                offsets[i] += len(out.text)
                if out.text or lp or out.finish_reason:
                    ch = {"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
                    yield _sse({**base, "choices": [ch], **extra_fields})
            state.record(choices, prompts, t0)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(choices, prompts)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            _errors_as_events(stream()), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    all_lps = await _until_disconnect(request, _collect(state, gens, choices, t0))
    if all_lps is None:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    state.record(choices, prompts, t0)
    return {
        **{k: v for k, v in base.items() if k != "object"},
        "object": "text_completion",
        "choices": [
            {
                "index": c.index,
                "text": (echo_text[c.prompt_index] if body.echo else "") + c.text,
                "logprobs": _completion_logprobs(llm, all_lps[c.index], 0) if want_lp else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": _usage(choices, prompts),
    }
