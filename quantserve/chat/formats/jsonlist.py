"""Families that write a reply's calls as JSON objects between two markers:

| family | a call looks like |
|---|---|
| Nemotron Nano 2 | `<TOOLCALL>[{"name": …, "arguments": {…}}, …]</TOOLCALL>` |
| Apriel 1.5 / 1.6 | `<tool_calls>[{"name": …, "arguments": {…}}, …]</tool_calls>` |
| MiniMax M1 | `<tool_calls>\\n{"name": …, "arguments": {…}}\\n…</tool_calls>` (one object a line) |
| Command R7B, Cohere 2 | `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": …, "parameters": {…}}]<|END_ACTION|>` |
| GigaChat 3.1 | `<|function_call|>{"name": …, "arguments": {…}}` |
| Apertus | `<|tools_prefix|>[{"NAME": {…}}, …]<|tools_suffix|>` (the name is the key) |
| Command R+ (tool use) | `Action:\n```json\n[{"tool_name": …, "parameters": {…}}, …]```` |
| FireFunction v2 | ` functools[{"name": …, "arguments": {…}}, …]` (no closing marker) |
| Granite 3.3 | `<|tool_call|>[{"name": …, "arguments": {…}}, …]` (no closing marker) |
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from quantserve.chat.formats import TEXT_RULE, GrammarSpec, ToolFormat, calls_grammar, one_of, trigger_rule
from quantserve.chat.reply import CallStream, Event, JsonCallParser, cut_char
from quantserve.chat.tools import Tool
from quantserve.structured import Grammar, embeddable, json_rule, lark_text


@dataclass(frozen=True)
class Shape:
    """`open`/`close`: the markers around the calls (close "": none). The calls are an array, or with `lines` one
    object a line, or with `single` one object. `name`/`args`: the keys of a call's name and arguments (`name` "":
    the name is the object's only key). `ids`: the key of a call's id, which the grammar writes as a number ("" for
    none). `dropped`: markers around the answer, dropped from its text (Command R7B's response section)."""

    open: str
    close: str
    lines: bool = False
    name: str = "name"
    args: str = "arguments"
    ids: str = ""
    single: bool = False
    dropped: tuple[str, ...] = ()


class JsonList(ToolFormat):
    shape: ClassVar[Shape]

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.shape.open,)

    def _call_schema(self, tool: Tool) -> dict[str, Any]:
        s = self.shape
        params = embeddable(tool.parameters, f"{tool.name}.")
        if not s.name:
            props: dict[str, Any] = {tool.name: params}
        else:
            props = {**({s.ids: {"type": "string", "pattern": "^[0-9]{1,2}$"}} if s.ids else {})}
            props |= {s.name: {"const": tool.name}, s.args: params}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    def grammar(self, spec: GrammarSpec) -> Grammar:
        s = self.shape
        item = one_of([self._call_schema(t) for t in spec.tools])
        close = f" {lark_text(s.close, spec.special)}" if s.close else ""
        if s.lines:
            more = '("\\n" call)*' if spec.parallel else ""
            body = f'"\\n" call {more} "\\n"'
            call = f"call: {json_rule(item)}\n"
        elif s.single:  # one call, one object (GigaChat's templates take one a turn)
            body, call = json_rule(item), ""
        else:
            array = {
                "type": "array",
                "items": item,
                "minItems": 1,
                **({} if spec.parallel else {"maxItems": 1}),
            }
            body, call = json_rule(array), ""
        rules = f"{call}rest: {body}{close}\ncalls: {lark_text(s.open, spec.special)} rest"
        free = f"%llguidance {{}}\nstart: TEXT | trig rest\n{trigger_rule(s.open, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, rules, free)

    def parser(self, tools: frozenset[str]) -> JsonListParser:
        return JsonListParser(self.new_id, tools, self.shape)


class JsonListParser(JsonCallParser):
    def __init__(self, new_id, tools, shape: Shape):
        super().__init__(new_id, tools)
        self.s = shape
        self.state = "text"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        s = self.s
        while True:
            if self.state == "junk":  # after a malformed call
                return out
            if self.state == "text":
                events, marker = self._text_until_any((s.open, *s.dropped), final)
                out += events
                if marker is None:
                    return out
                self.cur += len(marker)
                if marker in s.dropped:
                    continue
                self.state = "value"
            if self.state == "value":  # an array, or (lines) the next object, or the close
                rest = self.text[self.cur :].lstrip()
                at = len(self.text) - len(rest)
                if s.close and rest.startswith(s.close):
                    self.cur, self.state = at + len(s.close), "text"
                    continue
                if not rest or (s.close and s.close.startswith(cut_char(rest))):
                    self.cut = (
                        final and not self.calls
                    )  # opened, and nothing written (a missing close is forgiven)
                    return out
                if rest[0] != ("[" if self._array else "{"):
                    self.malformed = True  # not this family's shape
                    return out
                self.cur = at
                self._scan(at)
                self.state = "scan"
            if self.state == "scan":
                sc = self._advance(final)
                if not self.s.name:  # the name is the key: each object read whole once it is
                    while (span := sc.spans.get((len(self.calls),))) is not None and span.end is not None:
                        out += self._whole(json.loads(sc.text[span.start : span.end]))
                        if self.malformed:
                            return out
                    if sc.error:
                        self.malformed = True
                        return out
                    if not sc.done:
                        self.cut = final
                        return out
                elif sc.text.lstrip().startswith("["):
                    while (len(self.calls),) in sc.spans:
                        self._call(sc, (len(self.calls),), **self._keys())
                else:
                    if not self.calls or self.calls[-1].scanner is not sc:
                        self._call(sc, (), **self._keys())
                for call in self.calls:
                    out += call.poll()
                    if call.rejected:  # nothing after a call to no tool is read
                        self.malformed, self.state = True, "junk"
                        return out
                    if s.ids and isinstance(
                        call, CallStream
                    ):  # Command R writes each call's id in its object
                        written = call.scanner.string_value((*call.prefix, s.ids))
                        call.id = written if written else call.id
                if sc.error:
                    self.malformed, self.state = True, "junk"
                    return out
                if not sc.done:
                    self.cut = final
                    return out
                self.cur = self._scan_end()
                self.state = "value" if (s.lines or s.close) else "text"
                if not s.lines and s.close:
                    self.state = "close"
            if self.state == "close":
                rest = self.text[self.cur :].lstrip()
                if rest.startswith(s.close):
                    self.cur = len(self.text) - len(rest) + len(s.close)
                elif not final and s.close.startswith(cut_char(rest)):
                    return out
                self.state = "text"

    @property
    def _array(self) -> bool:
        """The calls are an array (else one object, or one a line)."""
        return not self.s.lines and not self.s.single

    def _keys(self) -> dict[str, Any]:
        return {"name_key": self.s.name, "args_keys": (self.s.args,), "whole": bool(self.s.ids)}

    def _whole(self, item: Any) -> list[Event]:
        """A call of Apertus's shape, {NAME: {arguments}}."""
        if not isinstance(item, dict) or len(item) != 1:
            self.malformed = True
            return []
        ((name, args),) = item.items()
        return self._whole_call(name, args)


class NemotronV2(JsonList):
    name = "nemotron-v2"
    priority = 60
    shape = Shape("<TOOLCALL>", "</TOOLCALL>")


class Apriel(JsonList):
    name = "apriel"
    priority = 61
    shape = Shape("<tool_calls>", "</tool_calls>")


class MiniMaxM1(JsonList):
    name = "minimax-m1"
    priority = 62
    shape = Shape("<tool_calls>", "</tool_calls>", lines=True)


class CommandR(JsonList):
    name = "command-r"
    priority = 63
    frames = True
    shape = Shape(
        "<|START_ACTION|>",
        "<|END_ACTION|>",
        name="tool_name",
        args="parameters",
        ids="tool_call_id",
        dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    )


class GigaChat(JsonList):
    name = "gigachat"
    priority = 64
    shape = Shape("<|function_call|>", "", single=True)


class Apertus(JsonList):
    name = "apertus"
    priority = 65
    shape = Shape("<|tools_prefix|>", "<|tools_suffix|>", name="")


class GigaChat3(JsonList):
    name = "gigachat3"
    priority = 66
    shape = Shape("<|message_sep|>\n\nfunction call<|role_sep|>", "", single=True)


class CommandRPlus(JsonList):
    """Command R+'s tool-use template; its reply is also asked for a `directly-answer` call when it needs no
    tool, which is not one of the request's tools, so such a reply reads as text."""

    name = "command-r-plus"
    priority = 67
    shape = Shape("Action:\n```json\n", "```", name="tool_name", args="parameters")

    def prepare(self, messages, tools, choice, parallel):
        """The template writes each parameter's description and fails on one without: those get an empty one."""
        out, extra = super().prepare(messages, tools, choice, parallel)
        for tool in extra.get("tools", ()):
            params = tool["function"]["parameters"]
            props = params.get("properties") or {}
            params["properties"] = {k: {"description": "", **v} for k, v in props.items()}
        return out, extra


class FireFunction(JsonList):
    """FireFunction v2 reads the tools as JSON text in a variable of its own, `functions` (see prepare)."""

    name = "firefunction-v2"
    priority = 68
    shape = Shape("functools", "")

    def prepare(self, messages, tools, choice, parallel):
        out, extra = super().prepare(messages, tools, choice, parallel)
        if extra:
            extra["functions"] = json.dumps(extra["tools"], indent=4)
        return out, extra


class Granite(JsonList):
    """Granite 3.3 describes the tools and the format in its system turn but never writes a call, so it is known
    by its words (`hints`), and a call of the history goes into the assistant's content as the model wrote it."""

    name = "granite"
    priority = 69
    shape = Shape("<|tool_call|>", "")
    hints = ("<|tool_call|>", "available_tools")

    def prepare(self, messages, tools, choice, parallel):
        out, extra = super().prepare(messages, tools, choice, parallel)
        return [_calls_as_text(m, self.shape.open) for m in out], extra


def _calls_as_text(message: dict[str, Any], marker: str) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    # the arguments are objects again by now (ToolFormat.prepare)
    written = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    content = message.get("content") or ""
    text = f"{content}{marker}{json.dumps(written, ensure_ascii=False)}"
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
