"""A chat request made ready for the engine: the prompt through the model's template (with its tools, in its
tool-call format), the grammar that holds the reply to that format or to response_format, and the parser for it.

Every API (chat completions, Responses, Anthropic Messages) builds a ChatRequest and goes through here, so tools
behave the same whichever API a client speaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantserve.chat.formats import ToolFormat, detect
from quantserve.chat.reply import ReplyAssembler
from quantserve.chat.template import ChatTemplate
from quantserve.chat.tools import CallChecker, Tool, ToolChoice
from quantserve.structured import Grammar, json_schema_grammar


@dataclass(frozen=True)
class ChatRequest:
    """What a chat asks for, independent of the API it came through.

    `messages` are OpenAI-style dicts with string content; an assistant message's `tool_calls` hold their
    arguments as JSON text, a `tool` message names its call in `tool_call_id`.
    """

    messages: list[dict[str, Any]]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    response_schema: dict[str, Any] | None = None  # response_format: the reply is JSON of this schema
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    grammar: Grammar | None
    format: ToolFormat | None  # set when the reply may hold tool calls
    request: ChatRequest

    @property
    def skip_special_tokens(self) -> bool:
        """Whether control tokens may print nothing: not when the reply's tool-call markers are control tokens
        (`[TOOL_CALLS]`, `<|python_tag|>`), which the parser must see."""
        return self.format is None or not self.format.native

    def assembler(self) -> ReplyAssembler | None:
        """A parser for one reply (one per choice), or None when the reply is plain text."""
        if self.format is None:
            return None
        req = self.request
        return ReplyAssembler(self.format.parser(), CallChecker(req.tools), req.parallel_tool_calls)


def tool_format(template: ChatTemplate) -> ToolFormat:
    """The template's tool-call format, found once per template."""
    fmt = template.__dict__.get("_tool_format")
    if fmt is None:
        fmt = template.__dict__["_tool_format"] = detect(template.probe)
    return fmt


def build_prompt(template: ChatTemplate, req: ChatRequest, special: dict[str, int]) -> ChatPrompt:
    """Render `req` and choose its grammar. `special` maps the vocabulary's control-token texts to their ids.

    Raises:
        ChatTemplateError: the template rejects the messages.
        InvalidRequestError: a schema the grammar engine cannot take.
    """
    messages = req.messages
    if "developer" not in template.source:  # OpenAI's newer name for the system role (llama.cpp maps it too)
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    history_has_tools = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    fmt = tool_format(template) if req.calls_tools or history_has_tools else None
    extra: dict[str, Any] = {}
    if fmt is not None:
        messages, extra = fmt.prepare(messages, req.tools, req.tool_choice, req.parallel_tool_calls)
    text = template.render(messages, add_generation_prompt=True, **{**req.template_kwargs, **extra})
    grammar = None
    if req.calls_tools:
        assert fmt is not None
        choice = req.tool_choice
        allowed = tuple(t for t in req.tools if choice.name is None or t.name == choice.name)
        grammar = fmt.grammar(allowed, choice, req.parallel_tool_calls, req.response_schema, special)
    elif req.response_schema is not None:
        grammar = json_schema_grammar(req.response_schema, param="response_format")
    return ChatPrompt(text, grammar, fmt if req.calls_tools else None, req)
