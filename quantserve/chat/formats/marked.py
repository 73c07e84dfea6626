"""Families that write each call as a header naming the tool, then the arguments as JSON, between markers:

| family | a call looks like |
|---|---|
| DeepSeek V3.1 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>` |
| DeepSeek R1 | the same section, `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{…}\\n```<｜tool▁call▁end｜>` |
| Kimi K2 | `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{…}<|tool_call_end|>…` |
| Functionary v3.1 | `<function=NAME>{…}</function>` |
| Solar Open | `<|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{…}<|tool_call:end|><|calls|>` |

A family is its markers (a `Marks`); one parser and one grammar serve them all. Markers are matched as text (the
control tokens print their text: ChatPrompt.skip_special_tokens) and written in grammars by token id where the
vocabulary has them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from quantserve.chat.formats import TEXT_RULE, GrammarSpec, ToolFormat, calls_grammar, trigger_rule
from quantserve.chat.reasoning import holdback
from quantserve.chat.reply import Event, JsonCallParser, cut_char
from quantserve.chat.tools import Tool
from quantserve.structured import Grammar, json_rule, lark_text


@dataclass(frozen=True)
class Marks:
    """`section`: the markers around all of a reply's calls (None: each call stands alone). `start`: the text a
    call begins with. `header`: matches a call from `start` to its arguments, with the tool's name as group
    "name" (and the call's id as group "id", where the family writes one). `close`: what follows the arguments.
    `write`: the header of a call of NAME, as the grammar writes it ("{n}" for its index)."""

    section: tuple[str, str] | None
    start: str
    header: re.Pattern[str]
    close: str
    write: str


class Marked(ToolFormat):
    """The format of one family of MARKS (a subclass per family sets it)."""

    marks: ClassVar[Marks]

    def grammar(self, spec: GrammarSpec) -> Grammar:
        m = self.marks
        calls = " | ".join(_call_rule(m, t, spec) for t in spec.tools)
        more = "(/\\s*/ call)*" if spec.parallel else ""
        if m.section is not None:
            rest = f"/\\s*/ call {more} /\\s*/ {lark_text(m.section[1], spec.special)}"
            rules = f"call: {calls}\nrest: {rest}\ncalls: {lark_text(m.section[0], spec.special)} rest"
            trigger, after = m.section[0], "rest"
        else:  # the start of a call triggers it: what follows the start, then any further calls
            tails = " | ".join(_call_rule(m, t, spec, with_start=False) for t in spec.tools)
            rules = f"call: {calls}\ntail: {tails}\ncalls: call {more}"
            trigger, after = m.start, f"tail {more}"
        free = f"%llguidance {{}}\nstart: TEXT | trig {after}\n{trigger_rule(trigger, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, rules, free)

    @property
    def markers(self) -> tuple[str, ...]:
        m = self.marks
        return (m.section[0], m.start) if m.section else (m.start,)

    def parser(self, tools: frozenset[str]) -> MarkedParser:
        return MarkedParser(self.new_id, tools, self.marks)


def _call_rule(m: Marks, tool: Tool, spec: GrammarSpec, with_start: bool = True) -> str:
    written = m.write.format(name=tool.name, n="\0")
    if not with_start:
        written = written.removeprefix(m.start)
    head, _, tail = written.partition("\0")
    header = lark_text(head, spec.special) + (
        " /[0-9]{1,2}/ " + lark_text(tail, spec.special) if tail else ""
    )
    close = f" {lark_text(m.close, spec.special)}" if m.close else ""
    return f"{header} {json_rule(tool.parameters)}{close}"


class MarkedParser(JsonCallParser):
    """Text, then calls: each header read whole (held back until it is), its JSON scanned as it streams."""

    HEADER_MAX = 256  # a header longer than this without matching is not one

    def __init__(self, new_id, tools, marks: Marks):
        super().__init__(new_id, tools)
        self.m = marks
        self.state = "text"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        m = self.m
        while True:
            if self.state == "text":
                # calls begin with the section's opening, or with a call's start without one (Kimi K2 Thinking)
                markers = (m.section[0], m.start) if m.section is not None else (m.start,)
                events, marker = self._text_until_any(markers, final)
                out += events
                if marker is None:
                    return out
                if marker == m.start:
                    self.state = "header"  # the start is part of the header
                else:
                    self.cur, self.state = self.cur + len(marker), "section"
            if self.state == "section":
                assert m.section is not None
                rest = self.text[self.cur :].lstrip()
                at = len(self.text) - len(rest)
                if rest.startswith(m.section[1]):
                    self.cur = at + len(m.section[1])
                    self.state = "text"
                    continue
                if rest.startswith(m.start):
                    self.cur = at
                    self.state = "header"
                elif any(x.startswith(cut_char(rest)) for x in (m.section[1], m.start)):
                    self.cut = final and bool(rest)  # the reply ended in a marker's first characters
                    return out
                else:
                    self.malformed = True  # something else inside the section
                    return out
            if self.state == "header":
                found = m.header.match(self.text, self.cur)
                if found is None:
                    if final or len(self.text) - self.cur > self.HEADER_MAX:
                        if final and not self.malformed:
                            self.cut = True
                        else:
                            self.malformed = True
                    return out
                call_id = (found.groupdict().get("id") or "").strip()
                self._call(self._scan(found.end()), (), name=found.group("name").strip(), call_id=call_id)
                self.state = "args"
            if self.state == "args":
                if not self._read_args(final, out):
                    return out
                self.state = "close"
            if self.state == "close":
                rest = self.text[self.cur :].lstrip()
                close = m.close.lstrip()  # the whitespace before it is the model's to leave out
                if close and rest.startswith(close):
                    self.cur = len(self.text) - len(rest) + len(close)
                elif close and not final and holdback(rest, (close,)) == len(rest):
                    return out  # the close may still be coming
                self.state = "section" if m.section is not None else "text"  # a missing close is forgiven
            if self.state == "junk":
                return out


def _marks(section, start, header, close, write) -> Marks:
    return Marks(section, start, re.compile(header), close, write)


DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")


class DeepSeekV31(Marked):
    name = "deepseek-v3.1"
    priority = 40
    marks = _marks(
        DEEPSEEK_SECTION,
        "<｜tool▁call▁begin｜>",
        r"<｜tool▁call▁begin｜>(?P<name>[^<\n]+?)<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
    )


class DeepSeekR1(Marked):
    name = "deepseek-r1"
    priority = 41
    marks = _marks(
        DEEPSEEK_SECTION,
        "<｜tool▁call▁begin｜>",
        r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(?P<name>[^\n]+)\n```json\n",
        "\n```<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
    )


class KimiK2(Marked):
    name = "kimi-k2"
    priority = 42
    marks = _marks(
        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        "<|tool_call_begin|>",
        r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[\w.-]+?)(?::\d+)?)\s*<\|tool_call_argument_begin\|>",
        "<|tool_call_end|>",
        "<|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>",
    )


class FunctionaryV31(Marked):
    name = "functionary-v3.1"
    priority = 43
    marks = _marks(None, "<function=", r"<function=(?P<name>[^>\n]+)>", "</function>", "<function={name}>")


class Solar(Marked):
    name = "solar"
    priority = 44
    marks = _marks(
        ("<|tool_calls|>", "<|calls|>"),
        "<|tool_call:begin|>",
        r"<\|tool_call:begin\|>(?P<id>[^<]*)<\|tool_call:name\|>(?P<name>[^<]+)<\|tool_call:args\|>",
        "<|tool_call:end|>",
        "<|tool_call:begin|>{n}<|tool_call:name|>{name}<|tool_call:args|>",
    )
