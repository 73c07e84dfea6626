"""Functionary v3.2: a reply is a run of messages, each addressed by its first line,

    >>>all\\nTEXT>>>NAME\\n{…}>>>NAME2\\n{…}

(the generation prompt already wrote the first `>>>`). A message to `all` is the answer, one to a tool is a call
whose body is its arguments' JSON. Functionary's built-in `python` tool, whose body is raw code rather than JSON, is
not one of a request's tools, so such a message does not read as a call.
"""

from __future__ import annotations

from quantserve.chat.formats import GrammarSpec, ToolFormat, calls_grammar
from quantserve.chat.reasoning import holdback
from quantserve.chat.reply import Event, JsonCallParser
from quantserve.structured import Grammar, json_rule, lark_literal

NEXT = ">>>"
ANSWER = "all"


class FunctionaryV32(ToolFormat):
    name = "functionary-v3.2"
    priority = 48
    markers = (NEXT,)
    frames = True

    def grammar(self, spec: GrammarSpec) -> Grammar:
        tools = " | ".join(f'{lark_literal(t.name)} "\\n" {json_rule(t.parameters)}' for t in spec.tools)
        more = f'("{NEXT}" call)*' if spec.parallel else ""
        rules = f"call: {tools}\ncalls: call {more}"
        words = f'"{ANSWER}\\n"'
        free = (
            f"%llguidance {{}}\nstart: calls | {words} TEXT | {words} trig calls\n"
            f'trig[lazy]: TEXT "{NEXT}"\nTEXT: /(.|\\n)*/'
        )
        return calls_grammar(spec, rules, free)

    def parser(self, tools: frozenset[str]) -> RecipientParser:
        return RecipientParser(self.new_id, tools)


class RecipientParser(JsonCallParser):
    """Messages one after another: the recipient line read whole, then the body as content or as a call's JSON.
    A first line that names neither `all` nor a tool is text (a reply written without a recipient)."""

    LINE_MAX = 128  # a recipient longer than this is not one

    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "recipient"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "recipient":
                k = self.text.find("\n", self.cur)
                line = self.text[self.cur : k if k != -1 else len(self.text)]
                if k == -1 and not final and len(line) <= self.LINE_MAX:
                    return out
                name = line.strip()
                if k != -1 and name == ANSWER:
                    self.cur, self.state = k + 1, "text"
                elif k != -1 and name in self.tools:
                    self._call(self._scan(k + 1), (), name=name)
                    self.state = "args"
                elif final and not line.strip(" \n") and self.calls:
                    return out  # a `>>>` at the very end, with nothing after it
                elif final and name in self.tools:
                    self.cut = True  # the reply ended inside the recipient line of a call
                    return out
                else:
                    self.state = "text"  # not a recipient: the text is what it is
            if self.state == "text":
                events, found = self._text_until(NEXT, final)
                out += events
                if not found:
                    return out
                self.state = "recipient"
            if self.state == "args":
                if not self._read_args(final, out):
                    self.cut = final and not self.malformed
                    return out
                rest = self.text[self.cur :].lstrip()
                if rest.startswith(NEXT):
                    self.cur, self.state = len(self.text) - len(rest) + len(NEXT), "recipient"
                    continue
                if not final and holdback(rest, (NEXT,)) == len(rest):
                    return out  # the next message may be coming
                self.state = "text"  # what follows a call without a recipient is text
            if self.state == "junk":
                return out
