"""Chat templates: a model's Jinja template rendered in jinja2's ImmutableSandboxedEnvironment, and what a probe
render tells about it (does it know tools, a system role, tool results; how does it write a tool call)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from quantserve.errors import ChatTemplateError, ConfigError

if TYPE_CHECKING:
    from quantserve.chat.reasoning import ReasoningFormat


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template rejected these messages: {message}", param="messages")


class _GenerationBlock(Extension):
    """transformers' `{% generation %}…{% endgeneration %}` (it marks the assistant's tokens for training masks):
    rendered as its plain content."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    # Same defaults as transformers' apply_chat_template (non-ASCII kept as is); a filter's generator (`tools |
    # map(...)`) is written as the list it yields, as llama.cpp's minja writes it.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, default=_listed)


def _listed(value: Any) -> Any:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The lists a render was given (by id): templates may build their own lists, never change these.
_INPUTS: ContextVar[frozenset[int]] = ContextVar("template_inputs", default=frozenset())


def _lists_in(value: Any, found: set[int]) -> set[int]:
    if isinstance(value, list):
        found.add(id(value))
        for v in value:
            _lists_in(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _lists_in(v, found)
    return found


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, except that a template may append to and extend the lists it makes itself (Kimi's
    templates build their output that way); the messages, tools and other inputs stay immutable."""

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, list) and attr in ("append", "extend") and id(obj) not in _INPUTS.get():
            return True
        return super().is_safe_attribute(obj, attr, value)


def read_template_file(path: str | Path) -> str:
    """A --chat-template file's Jinja source.

    Raises:
        ConfigError: it cannot be read, or is not UTF-8 text.
    """
    p = Path(path).expanduser()
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(
            f"cannot read --chat-template file {p}: {reason}; give a Jinja template file",
            param="chat_template",
        ) from None


def _context() -> dict[str, Any]:
    """Variables some templates read beyond transformers' own: today's date as `datetime` (llama.cpp passes it
    too, as "%b %d %Y": common_chat_extra_context in common/chat.cpp), and FireFunction's `functions`, the tools
    as JSON text, empty unless its tool format sets it (chat.formats.jsonlist.FireFunction)."""
    return {"datetime": datetime.now().strftime("%b %d %Y"), "functions": ""}


class ChatTemplate:
    """Renders OpenAI-style messages into a prompt string, exactly as transformers would (trim_blocks,
    lstrip_blocks, loopcontrols, raise_exception, strftime_now), but sandboxed: templates come from model files."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "the model"):
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ConfigError(f"the chat template from {origin} does not parse: {exc}") from exc
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token

    @staticmethod
    @lru_cache(maxsize=64)
    def shared(source: str, bos_token: str, eos_token: str, origin: str) -> ChatTemplate:
        """One ChatTemplate per (source, BOS, EOS, origin) in this process, so that its probe renders (`probe`,
        `reasoning`) are made once: the plan's tool-call and reasoning names and the loaded model's parsers come
        from the same object. A ChatTemplate is not changed after it is made."""
        return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, origin=origin)

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> ChatTemplate:
        return cls(read_template_file(path), origin=str(path), **kw)

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        token = _INPUTS.set(frozenset(_lists_in([messages, extra], set())))
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **{**_context(), **extra},
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template failed to render these messages: {exc}", param="messages"
            ) from exc
        finally:
            _INPUTS.reset(token)

    # ---- what the template can do -------------------------------------------------------------------

    @cached_property
    def reasoning(self) -> ReasoningFormat | None:
        """How the template marks reasoning, from probe renders (quantserve.chat.reasoning)."""
        from quantserve.chat.reasoning import detect_reasoning

        return detect_reasoning(self)

    @cached_property
    def probe(self) -> TemplateProbe:
        """Render a few probe conversations once and keep what they show (llama.cpp's minja does the same)."""
        return TemplateProbe.of(self)


PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "Looks something up.",
        "parameters": {
            "type": "object",
            "properties": {"arg": {"type": "string", "description": "What to look up."}},
            "required": ["arg"],
        },
    },
}
PROBE_CALL = {
    "id": "probe0001",
    "name": "probe_tool",
    "arguments": {"arg": "probe value"},
}  # a 9-character id


@dataclass(frozen=True)
class TemplateProbe:
    """What probe renders of a template showed.

    `turn` is the assistant turn that holds PROBE_CALL, as the template writes it (the text after the generation
    prompt); tool-call formats are recognised by parsing it back (quantserve.chat.formats).
    """

    turn: str | None  # None when the template failed to render a tool call
    system_role: bool  # a system message shows in the prompt
    tool_role: bool  # a `tool` message's content shows in the prompt
    text_arguments: bool = False  # the template writes a call's arguments as the JSON text it is given
    none_content: bool = (
        False  # the template writes calls only for an assistant message whose content is none
    )

    @classmethod
    def of(cls, template: ChatTemplate) -> TemplateProbe:
        user = {"role": "user", "content": "probe question"}
        call = {
            "id": PROBE_CALL["id"],
            "type": "function",
            "function": {"name": PROBE_CALL["name"], "arguments": PROBE_CALL["arguments"]},
        }
        assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
        result = {
            "role": "tool",
            "tool_call_id": PROBE_CALL["id"],
            "name": PROBE_CALL["name"],
            "content": "probe result",
        }

        def render(messages, gen: bool, tools=None) -> str | None:
            try:
                extra = {"tools": tools} if tools else {}
                return template.render(messages, add_generation_prompt=gen, **extra)
            except ChatTemplateError:
                return None

        head = render([user], True, [PROBE_TOOL])
        turn = None
        # templates differ in what they take: arguments as an object or as JSON text, and a call's content
        # empty or none (DeepSeek-R1's distills write calls only for none); the first that writes the call wins
        text_args = {
            **call,
            "function": {**call["function"], "arguments": json.dumps(PROBE_CALL["arguments"])},
        }
        variants = [
            {**assistant, "content": c, "tool_calls": [k]} for k in (call, text_args) for c in ("", None)
        ]
        text_arguments = none_content = False
        written = assistant
        for variant in variants:
            full = render([user, variant], False, [PROBE_TOOL])
            if (
                head is not None
                and full is not None
                and PROBE_CALL["name"] in full[_turn_start(head, full) :]
            ):
                turn = full[_turn_start(head, full) :]
                text_arguments = variant["tool_calls"][0] is text_args
                none_content = variant["content"] is None
                written = variant
                break
        system = render([{"role": "system", "content": "probe system"}, user], True) or ""
        tool = render([user, written, result], True) or ""
        return cls(
            turn=turn,
            system_role="probe system" in system,
            tool_role="probe result" in tool,
            text_arguments=text_arguments,
            none_content=none_content,
        )


def _turn_start(head: str, full: str) -> int:
    """Where the assistant turn starts in `full`: after `head` (the prompt up to the generation prompt), or, for
    templates whose generation prompt differs from what they write in a turn (Qwen's <think>), after the last
    whitespace of what both share, so that a marker they both begin with ("<t…") is not cut in two."""
    if full.startswith(head):
        return len(head)
    k = len(os.path.commonprefix([head, full]))
    while k > 0 and not full[k - 1].isspace():
        k -= 1
    return k
