"""Llama 3.1/3.2/3.3: a call is the whole reply, a JSON object `{"name": …, "parameters": {…}}`, optionally after
`<|python_tag|>`; several calls are separated by ";". The templates render one call per assistant turn, so the
grammar asks for one."""

from __future__ import annotations

from quantserve.chat.formats import GrammarSpec, ToolFormat, call_schema, calls_grammar, one_of
from quantserve.chat.reply import Event, JsonCallParser
from quantserve.structured import Grammar, json_rule

PYTHON_TAG = "<|python_tag|>"


class Llama3(ToolFormat):
    name = "llama3"
    priority = 30

    def grammar(self, spec: GrammarSpec) -> Grammar:
        call = json_rule(one_of([call_schema(t, "parameters") for t in spec.tools]))
        # a reply that starts with "{" is a call; any other reply is free text (not starting with a space)
        free = "start: calls | TEXT\nTEXT: /[^{\\s](.|\\n)*/"
        return calls_grammar(spec, f"calls: {call}", free)

    def parser(self, tools: frozenset[str]) -> Llama3Parser:
        return Llama3Parser(self.new_id, tools)


class Llama3Parser(JsonCallParser):
    """A reply is calls or text, decided at its start. Until a JSON reply shows the name of a tool nothing is sent:
    a JSON object without one (a response_format reply, say) is text after all."""

    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "start"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state in (
                "start",
                "next",
            ):  # before a call: whitespace, ";" between calls, <|python_tag|>
                rest = self.text[self.cur :].lstrip()
                if self.state == "next" and rest.startswith(";"):
                    rest = rest[1:].lstrip()
                if rest.startswith(PYTHON_TAG):
                    rest = rest[len(PYTHON_TAG) :].lstrip()
                if not final and (not rest or PYTHON_TAG.startswith(rest)):
                    return out
                self.cur = len(self.text) - len(rest)
                if not rest.startswith("{"):
                    self.state = "text"  # the reply is text, or what follows the calls is
                    continue
                self._call(self._scan(self.cur), ())
                self.state = "call"
            if self.state == "call":
                sc = self._advance(final)
                call = self.calls[-1]
                out += call.poll()
                if not call.started and (call.rejected or sc.error or sc.done or final):
                    self.calls.pop()  # JSON, or something like it, but not a call: from here on it is text
                    self.state = "text"
                    continue
                if sc.error:
                    self.malformed = True
                    return out
                if not sc.done:
                    return out
                self.cur = self._scan_end()
                self.state = "next"
                continue
            # text (a template's end-of-turn marker, in a rendered turn)
            out += self.content.add(self.text[self.cur :])
            self.cur = len(self.text)
            return out
