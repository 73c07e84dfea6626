"""Hermes 2/3 and Qwen 2.5/3: each call is `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, text may
come before the calls."""

from __future__ import annotations

from quantserve.chat.formats import (
    TEXT_RULE,
    GrammarSpec,
    ToolFormat,
    call_schema,
    calls_grammar,
    one_of,
    trigger_rule,
)
from quantserve.chat.reply import Event, JsonCallParser
from quantserve.structured import Grammar, json_rule

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    priority = 20

    def grammar(self, spec: GrammarSpec) -> Grammar:
        call = json_rule(one_of([call_schema(t) for t in spec.tools]))
        body = f'"\\n" {call} "\\n" {spec.literal(CLOSE)}'
        calls = 'calls: call ("\\n" call)*' if spec.parallel else "calls: call"
        rules = f"call: {spec.literal(OPEN)} {body}\n{calls}"
        # free text, but once the model opens a call, the call is held to the tools' schemas
        tags = "tag* TEXT" if spec.parallel else "TEXT | tag"
        free = f"%llguidance {{}}\nstart: {tags}\ntag: trig {body}\n{trigger_rule(OPEN, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, rules, free)

    markers = (OPEN,)

    def parser(self, tools: frozenset[str]) -> HermesParser:
        return HermesParser(self.new_id, tools)


class HermesParser(JsonCallParser):
    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "text"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "text":
                events, found = self._text_until(OPEN, final)
                out += events
                if not found:
                    return out
                self._call(self._scan(self.cur), ())
                self.state = "call"
            if self.state == "call":
                if not self._read_args(final, out):
                    return out
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
