"""Hermes 2/3 and Qwen 2.5/3: each call is `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, text may
come before the calls."""

from __future__ import annotations

from typing import Any

from quantserve.chat.formats import TEXT_RULE, ToolFormat, call_schema, one_of, register, trigger_rule
from quantserve.chat.reply import Event, JsonCallParser, holdback
from quantserve.chat.tools import Tool, ToolChoice
from quantserve.structured import Grammar, json_rule, lark_grammar, lark_literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@register
class Hermes(ToolFormat):
    name = "hermes"
    priority = 20

    def grammar(
        self,
        tools: tuple[Tool, ...],
        choice: ToolChoice,
        parallel: bool,
        schema: dict[str, Any] | None,
        special: dict[str, int],
    ) -> Grammar:
        body = (
            f'"\\n" {json_rule(one_of([call_schema(t) for t in tools]))} "\\n" {lark_literal(CLOSE, special)}'
        )
        call = f"call: {lark_literal(OPEN, special)} {body}"
        calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
        if choice.mode == "required":
            lark = f"start: calls\n{call}\n{calls}"
        elif schema is not None:  # a reply is either calls or the JSON response_format asks for
            lark = f"start: calls | {json_rule(schema)}\n{call}\n{calls}"
        else:  # free text, but once the model opens a call the call is held to the tools' schemas
            tags = "tag* TEXT" if parallel else "TEXT | tag"
            lark = f"%llguidance {{}}\nstart: {tags}\ntag: trig {body}\n{trigger_rule(OPEN, special)}\n{TEXT_RULE}"
        return lark_grammar(lark, param="tools")

    def parser(self, tools: frozenset[str]) -> HermesParser:
        return HermesParser(self.new_id, tools)


class HermesParser(JsonCallParser):
    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "text"
        self.cur = 0  # text before this index is parsed

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "text":
                at = self.text.find(OPEN, self.cur)
                if at == -1:
                    rest = self.text[self.cur :]
                    end = len(self.text) - (0 if final else holdback(rest, (OPEN,)))
                    out += self.content.add(self.text[self.cur : end])
                    self.cur = end
                    return out
                out += self.content.add(self.text[self.cur : at])
                self.cur = at + len(OPEN)
                self._call(self._scan(self.cur), ())
                self.state = "call"
            if self.state == "call":
                sc = self._advance(final)
                out += self.calls[-1].poll()
                if sc.error or self.calls[-1].rejected:
                    self.malformed = True
                    self.state = "junk"
                    return out
                if not sc.done:
                    return out
                self.cur = self._scan_end()
                self.state = "close"
            if self.state == "close":
                rest = self.text[self.cur :].lstrip()
                if rest.startswith(CLOSE):
                    self.cur = len(self.text) - len(rest) + len(CLOSE)
                elif not final and CLOSE.startswith(rest):
                    return out  # the closing tag may still be coming
                self.state = "text"  # a missing closing tag is forgiven
            if self.state == "junk":
                return out
