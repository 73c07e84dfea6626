"""/v1/chat/completions and /v1/completions: requests → sequences → OpenAI responses or SSE streams."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from quantserve.chat import ChatRequest, ReasoningDelta, TextDelta
from quantserve.chat.tools import parse_openai_tool_choice, parse_openai_tools
from quantserve.errors import InvalidRequestError
from quantserve.llm import LLM
from quantserve.server.content import ContentReader
from quantserve.server.errors import error_body
from quantserve.server.generation import Run, sse, usage
from quantserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest, response_schema
from quantserve.server.state import ServerState
from quantserve.submission import Choice, TextRequest

router = APIRouter()


def _sampling(req, *, logprobs: bool, top_logprobs: int) -> dict:
    """The request's sampling fields (None: unset) as SamplingParams names them."""
    bias = None
    if req.logit_bias:
        try:
            bias = tuple((int(k), float(v)) for k, v in req.logit_bias.items())
        except ValueError as exc:
            raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from exc
    return dict(
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
        logit_bias=bias,
        ignore_eos=req.ignore_eos or None,
    )


# ---- chat --------------------------------------------------------------------------------------


def chat_request(body: ChatCompletionRequest, reader: ContentReader, llm: LLM) -> ChatRequest:
    """The OpenAI chat request as the library's ChatRequest (400s name the field at fault); its images' sources
    are left in `reader`. Thinking is switched by chat_template_kwargs.enable_thinking (vLLM's and llama.cpp's
    way) and bounded by reasoning_budget."""
    tools = parse_openai_tools(body.tools)
    kwargs = dict(body.chat_template_kwargs or {})
    enable = kwargs.pop("enable_thinking", None)
    if enable is not None and not isinstance(enable, bool):
        raise InvalidRequestError(
            f"'chat_template_kwargs.enable_thinking' must be true or false; got {enable!r}",
            param="chat_template_kwargs.enable_thinking",
        )
    asked = "reasoning_budget" if body.reasoning_budget is not None else None
    asked = asked or ("chat_template_kwargs.enable_thinking" if enable else None)
    return ChatRequest(
        messages=[m.for_template(i, reader) for i, m in enumerate(body.messages)],
        tools=tools,
        tool_choice=parse_openai_tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls,
        response_schema=response_schema(body.response_format),
        grammar=body.user_grammar(),
        template_kwargs=kwargs,
        continue_final=body.continue_final_message,
        reasoning=llm.reasoning_request(
            enable=enable, budget=body.reasoning_budget, effort=body.reasoning_effort, asked=asked
        ),
    )


def _chat_logprobs(llm: LLM, lps) -> list[dict]:
    def entry(tok: int, lp: float) -> dict:
        text = llm.token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(llm.token_bytes(tok))}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def _message(c: Choice) -> dict:
    reply = c.reply
    assert reply is not None
    message: dict = {
        "role": "assistant",
        "content": reply.content if reply.tool_calls else (reply.content or ""),
    }
    if reply.reasoning is not None:
        # llama.cpp's and DeepSeek's name, and vLLM's newer one: clients read one or the other
        message["reasoning_content"] = message["reasoning"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in reply.tool_calls
        ]
    return message


def _delta(event) -> dict:
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text, "reasoning": event.text}
    call: dict = {"index": event.index}
    if event.name is not None:  # a call's first delta
        call |= {
            "id": event.id,
            "type": "function",
            "function": {"name": event.name, "arguments": event.arguments},
        }
    else:
        call["function"] = {"arguments": event.arguments}
    return {"tool_calls": [call]}


class _Encoder:
    """What OpenAI's two streams share: the chunk's header, the usage chunk when stream_options asks for it, [DONE],
    and the error event."""

    media_type = "text/event-stream"
    object: str

    def __init__(self, run: Run, body: ChatCompletionRequest | CompletionRequest, rid: str):
        self.run, self.body = run, body
        self.base = {"id": rid, "object": self.object, "created": int(time.time()), "model": run.llm.name}
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.extra = {"usage": None} if self.include_usage else {}

    def opening(self) -> list[bytes]:
        return []

    def closing(self) -> list[bytes]:
        tail = [b"data: [DONE]\n\n"]
        if self.include_usage:
            tail.insert(
                0, sse({**self.base, "choices": [], "usage": usage(self.run.choices, self.run.prompts)})
            )
        return tail

    @staticmethod
    def error(message: str) -> list[bytes]:
        return [sse(error_body(message, "server_error")), b"data: [DONE]\n\n"]


class _ChatEncoder(_Encoder):
    """chat.completion and its chunks: a role chunk per choice, a delta per reply event (the output's logprobs on
    the first), a finish chunk per choice, the usage chunk if asked, [DONE]."""

    object = "chat.completion.chunk"

    def _chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None) -> bytes:
        ch = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**self.base, "choices": [ch], **self.extra})

    def opening(self) -> list[bytes]:
        return [self._chunk(c.index, {"role": "assistant", "content": ""}) for c in self.run.choices]

    def take(self, choice: Choice, out, events) -> list[bytes]:
        lp = {"content": _chat_logprobs(self.run.llm, out.logprobs)} if out.logprobs else None
        chunks = [self._chunk(choice.index, _delta(e), lp if k == 0 else None) for k, e in enumerate(events)]
        if lp and not events:
            chunks.append(self._chunk(choice.index, {}, lp))
        if choice.reply is not None:
            chunks.append(self._chunk(choice.index, {}, finish_reason=choice.reply.finish_reason))
        return chunks

    def response(self) -> dict:
        llm, choices = self.run.llm, self.run.choices
        return {
            **{k: v for k, v in self.base.items() if k != "object"},
            "object": "chat.completion",
            "choices": [
                {
                    "index": c.index,
                    "message": _message(c),
                    "logprobs": {"content": _chat_logprobs(llm, c.logprobs)} if self.body.logprobs else None,
                    "finish_reason": c.reply.finish_reason if c.reply else c.finish_reason,
                }
                for c in choices
            ],
            "usage": usage(choices, self.run.prompts),
        }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state: ServerState = request.app.state.qs
    llm = await state.acquire(request, body.model)
    t0 = time.perf_counter()
    reader = state.reader(llm)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    submission = llm.submit(
        TextRequest(
            chat=chat_request(body, reader, llm),
            images=await reader.load(state.media),
            max_tokens=body.max_completion_tokens or body.max_tokens,
            sampling=_sampling(body, logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0),
            n=body.n,
            request_id=rid,
        )
    )
    run = Run(state, request, llm, submission, t0)
    return await run.respond(_ChatEncoder(run, body, rid), body.stream)


# ---- completions -------------------------------------------------------------------------------


def _prompts(prompt) -> list:
    """`prompt` in each of its shapes (text, token ids, or a list of either) as a list of prompts."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]
    return list(prompt)


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


class _CompletionEncoder(_Encoder):
    """text_completion and its chunks: the echoed prompts, a chunk per output with text, logprobs or a finish
    reason, the usage chunk if asked, [DONE]."""

    object = "text_completion"

    def __init__(self, run: Run, body: CompletionRequest, rid: str):
        super().__init__(run, body, rid)
        llm, prompts = run.llm, run.prompts
        if isinstance(body.prompt, str):
            self.echo = {0: body.prompt}
        else:
            self.echo = {i: llm.detokenize(p) for i, p in enumerate(prompts)} if body.echo else {}
        self.offsets = {c.index: 0 for c in run.choices}

    def _chunk(self, index: int, text: str, logprobs=None, finish_reason=None) -> bytes:
        ch = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**self.base, "choices": [ch], **self.extra})

    def opening(self) -> list[bytes]:
        if not self.body.echo:
            return []
        return [self._chunk(c.index, self.echo[c.prompt_index]) for c in self.run.choices]

    def take(self, choice: Choice, out, events) -> list[bytes]:
        i = choice.index
        lp = _completion_logprobs(self.run.llm, out.logprobs, self.offsets[i]) if out.logprobs else None
        self.offsets[i] += len(out.text)
        return (
            [self._chunk(i, out.text, lp, out.finish_reason)] if out.text or lp or out.finish_reason else []
        )

    def response(self) -> dict:
        llm, choices, echo = self.run.llm, self.run.choices, self.body.echo
        return {
            **self.base,
            "choices": [
                {
                    "index": c.index,
                    "text": (self.echo[c.prompt_index] if echo else "") + c.text,
                    "logprobs": _completion_logprobs(llm, c.logprobs, 0)
                    if self.body.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": usage(choices, self.run.prompts),
        }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state: ServerState = request.app.state.qs
    llm = await state.acquire(request, body.model)
    if body.suffix:
        raise InvalidRequestError("'suffix' (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise InvalidRequestError("'best_of' is not supported (only best_of == n)", param="best_of")
    t0 = time.perf_counter()
    rid = f"cmpl-{uuid.uuid4().hex}"
    submission = llm.submit(
        TextRequest(
            prompts=_prompts(body.prompt),
            max_tokens=body.max_tokens,
            grammar=body.user_grammar(),
            sampling=_sampling(body, logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0),
            n=body.n,
            request_id=rid,
        )
    )
    run = Run(state, request, llm, submission, t0)
    return await run.respond(_CompletionEncoder(run, body, rid), body.stream)
