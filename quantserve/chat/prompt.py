"""A chat request made ready for the engine: the prompt through the model's template (with its tools, in its
tool-call format), the grammar that holds the reply to that format or to response_format, and the parser for it.

Every API (chat completions, Responses, Anthropic Messages) builds a ChatRequest and goes through here, so tools
behave the same whichever API a client speaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from quantserve.chat.formats import GrammarSpec, ToolFormat, detect
from quantserve.chat.reasoning import REASONING_KEYS, ReasoningFormat, ReasoningSplitter
from quantserve.chat.reasoning_request import ReasoningRequest, after_reasoning
from quantserve.chat.reply import ReplyAssembler
from quantserve.chat.template import ChatTemplate
from quantserve.chat.tools import CallChecker, Tool, ToolChoice
from quantserve.errors import ChatTemplateError, InvalidRequestError
from quantserve.structured import Grammar, check, json_schema_grammar


@dataclass(frozen=True)
class ChatRequest:
    """What a chat asks for, independent of the API it came through.

    `messages` are OpenAI-style dicts with string content (a user message with images: a list of
    `{"type": "text", "text"}` and `{"type": "image"}` parts, as transformers' processors give them to templates);
    an assistant message's `tool_calls` hold their
    arguments as JSON text, a `tool` message names its call in `tool_call_id`.
    """

    messages: list[dict[str, Any]]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    response_schema: dict[str, Any] | None = None  # response_format: the reply is JSON of this schema
    grammar: Grammar | None = None  # the request's own grammar (grammar, json_schema, structured_outputs)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # the last message is the assistant's, and the reply continues it (Anthropic's prefill)
    continue_final: bool = False
    reasoning: ReasoningRequest = ReasoningRequest()

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"

    @property
    def parallel(self) -> bool:
        """Several calls in one reply: as asked, but one for a named function (as OpenAI answers it)."""
        return self.parallel_tool_calls and self.tool_choice.name is None

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools a reply may call: the named one only, for a named choice."""
        name = self.tool_choice.name
        return tuple(t for t in self.tools if name is None or t.name == name) if self.calls_tools else ()

    @property
    def needs_format(self) -> bool:
        """Whether the template's tool-call format is needed: to call tools, or to render earlier calls."""
        return self.calls_tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in self.messages)


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    grammar: Grammar | None
    format: ToolFormat | None  # set when the reply may hold tool calls
    request: ChatRequest
    prefill: str = ""  # the text the reply continues (continue_final): the parser reads it first, silently
    reasoning: ReasoningFormat | None = None  # set when the reply may think
    separate: bool = True  # its reasoning is split from its answer (else left in the content)
    opened: bool = False  # the prompt ends inside a reasoning block
    budget: int | None = None  # reasoning tokens allowed (None: unbounded)

    @property
    def skip_special_tokens(self) -> bool:
        """Whether control tokens may print nothing: not when the reply's tool-call or reasoning markers are
        control tokens (`[TOOL_CALLS]`, `<|python_tag|>`, `<|channel|>`), which the parsers must see."""
        return (self.format is None or not self.format.native) and self.reasoning is None

    def assembler(self) -> ReplyAssembler | None:
        """A parser for one reply (one per choice), or None when the reply is plain text."""
        split = self.reasoning is not None and self.separate
        # --reasoning-format none: the reply's text as written, beginning with the block its prompt opened
        lead = ""
        if self.reasoning is not None and not self.separate and self.opened:
            lead = self.text[self.text.rfind(self.reasoning.start) :]
        if self.format is None and not split and not lead:
            return None
        req = self.request
        calls = self.format.markers if self.format is not None else ()
        splitter = ReasoningSplitter(self.reasoning, self.opened, calls) if split else None
        if self.format is None:
            return ReplyAssembler(None, reasoning=splitter, lead=lead)
        asm = ReplyAssembler(
            self.format.reply_parser(req.callable_tools), CallChecker(req.tools), req.parallel, splitter, lead
        )
        asm.feed(self.prefill)  # what the client wrote itself is not sent back
        return asm


def tool_format(template: ChatTemplate) -> ToolFormat:
    """The template's tool-call format (probe renders: cache it)."""
    return detect(template.probe, template.source, template.origin)


def build_prompt(
    template: ChatTemplate,
    fmt: ToolFormat | None,
    req: ChatRequest,
    special: dict[str, int],
    thinking: ReasoningFormat | None = None,
) -> ChatPrompt:
    """Render `req` and choose its grammar. `fmt` is the template's tool-call format (needed when
    req.needs_format); `thinking` its reasoning format; `special` maps the vocabulary's control-token texts to
    their ids.

    Raises:
        ChatTemplateError: the template rejects the messages, or rewrites a final message it should continue.
        InvalidRequestError: a schema the grammar engine cannot take; reasoning asked of a template without it.
    """
    rq = req.reasoning
    if thinking is None and rq.asked is not None:
        raise InvalidRequestError(
            f"'{rq.asked}' asks for reasoning, but this model's chat template has none (no thinking block); "
            "leave it out, or serve a reasoning model",
            param=rq.asked,
        )
    messages = [_with_reasoning_keys(m) for m in req.messages]
    if "developer" not in template.source:  # OpenAI's newer name for the system role (llama.cpp maps it too)
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    extra: dict[str, Any] = {}
    if req.needs_format:
        assert fmt is not None
        messages, extra = fmt.prepare(messages, req.tools, req.tool_choice, req.parallel)
    variables = {**req.template_kwargs, **rq.variables(thinking), **extra}
    prefill = ""
    if req.continue_final:
        text, prefill = _continued(template, messages, variables)
    else:
        text = template.render(messages, add_generation_prompt=True, **variables)
    opened = thinking is not None and thinking.opened_in(text)
    if thinking is not None and rq.mode == "on" and not opened and not req.continue_final:
        # thinking asked for, where the model would decide for itself: the prompt opens the block
        text += thinking.open_text
        opened = True
    if thinking is not None and rq.mode == "off" and not req.continue_final:
        # thinking off, where the template has no switch or leaves the block open: an empty block closes it
        if opened:
            text += thinking.close_text
        elif not thinking.switch:
            text += thinking.empty_block
        opened = False
    thinks = thinking is not None and rq.mode != "off"
    grammar = req.grammar
    if grammar is not None and (req.calls_tools or req.response_schema is not None):
        other = "tools" if req.calls_tools else "response_format"
        raise InvalidRequestError(
            f"'{grammar.param}' and '{other}' each constrain the reply: give one of them", param=grammar.param
        )
    if req.response_schema is not None:
        grammar = check(json_schema_grammar(req.response_schema, param="response_format"))
    if req.calls_tools:
        assert fmt is not None
        spec = GrammarSpec(req.callable_tools, req.tool_choice, req.parallel, req.response_schema, special)
        grammar = fmt.grammar(spec)
    if grammar is not None and thinks:
        assert thinking is not None
        grammar = after_reasoning(grammar, thinking, opened, special)
    if grammar is not None and prefill:
        grammar = replace(grammar, prefix=prefill)
    return ChatPrompt(
        text,
        grammar,
        fmt if req.calls_tools or (fmt is not None and fmt.frames) else None,
        req,
        prefill,
        reasoning=thinking if thinks else None,
        separate=rq.separate,
        opened=opened,
        budget=rq.budget if thinks else None,
    )


def _with_reasoning_keys(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's earlier reasoning under every key templates read it from (Qwen3 and DeepSeek
    `reasoning_content`, gpt-oss `thinking`, Gemma 4 `reasoning`); the template decides what it keeps."""
    if message.get("role") != "assistant":
        return message
    text = next((message[k] for k in REASONING_KEYS if isinstance(message.get(k), str) and message[k]), None)
    return message if text is None else {**message, **dict.fromkeys(REASONING_KEYS[:3], text)}


def _continued(template: ChatTemplate, messages: list[dict[str, Any]], variables: dict) -> tuple[str, str]:
    """The prompt that ends inside the last (assistant) message, as transformers' continue_final_message cuts it:
    rendered without a generation prompt, and cut just after that message's text. Returns (prompt, the text)."""
    final = messages[-1].get("content") or ""
    text = template.render(messages, add_generation_prompt=False, **variables)
    at = text.rfind(final) if final else -1
    if at == -1:
        raise ChatTemplateError(
            "the chat template does not write the final assistant message as given, so the reply cannot continue "
            "it; leave the assistant's prefill out",
            param="messages",
        )
    return text[: at + len(final)], final
