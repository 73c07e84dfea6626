"""Muse Glimmer: a reply is a run of messages, each addressed to a recipient,

    [<|start|>assistant] to=RECIPIENT<|message|>BODY<|eom|>

(the generation prompt already wrote the first `<|start|>assistant`; `<|eot|>` ends the turn). A message to
`user` is the answer, one to `self` is reasoning (quantserve.chat.reasoning splits off the first; a later one is
dropped from the answer), and one to a tool is a call whose body is ATEM markup:

    <atem:function_calls>\\n<atem:invoke name="NAME">\\n<atem:parameter name="KEY">VALUE</atem:parameter>\\n…

its values typed as in the other tagged formats (chat.formats.tagged). Markup written in a message to the user
stays text, as llama.cpp reads it: only a message to a tool calls one.
"""

from __future__ import annotations

import json
import re

from quantserve.chat.formats import TEXT_RULE, GrammarSpec, ToolFormat, calls_grammar
from quantserve.chat.formats.tagged import TaggedParser, tags_of, tool_rules
from quantserve.chat.reasoning import holdback
from quantserve.chat.reply import Event, ReplyParser
from quantserve.chat.tools import Tool
from quantserve.structured import Grammar, lark_literal, lark_text

START, MESSAGE, EOM, EOT = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"
ENDS = (EOM, EOT, START)  # what ends a body: its end token, or the next message's start
_RECIPIENT = re.compile(r"\s*(?:<\|start\|>\s*assistant)?\s*to=(?P<to>[^\s<]+)\s*$")
ATEM = tags_of(
    ("<atem:function_calls>", "</atem:function_calls>"),
    "<atem:invoke name=",
    r'<atem:invoke name="(?P<name>[^"]+)">',
    "</atem:invoke>",
    r'<atem:parameter name="(?P<key>[^"]+)">',
    "</atem:parameter>",
    '<atem:invoke name="{name}">',
    '<atem:parameter name="{key}">',
)


class MuseGlimmer(ToolFormat):
    name = "muse-glimmer"
    priority = 49
    frames = True

    def grammar(self, spec: GrammarSpec) -> Grammar:
        """A call is a message of its own: ` to=NAME<|message|>` and one invoke; a further one follows `<|eom|>`,
        and so may the calls after an answer in words (a message to the user ended by `<|eom|>`)."""
        lit = spec.literal
        rules = [tool_rules(ATEM, i, tool, spec, '"\\n"') for i, tool in enumerate(spec.tools)]
        opening, closing = (lark_text(x, spec.special) for x in ATEM.section)
        heads = " | ".join(
            f'{lark_literal(f" to={t.name}")} {lit(MESSAGE)} {opening} "\\n" c{i}'
            for i, t in enumerate(spec.tools)
        )
        rules.append(f'one: ({lit(START)} "assistant")? ({heads}) "\\n" {closing}')
        more = f"({lit(EOM)} one)*" if spec.parallel else ""
        rules.append(f"calls: one {more}")
        answer = f'({lit(START)} "assistant")? " to=user" {lit(MESSAGE)}'
        free = (
            f"%llguidance {{}}\nstart: calls | {answer} TEXT | {answer} trig calls\n"
            f"trig[lazy]: TEXT {lit(EOM)}\n{TEXT_RULE}"
        )
        return calls_grammar(spec, "\n".join(rules), free)

    def parser(self, tools: frozenset[str]) -> MuseParser:
        return MuseParser(self.new_id, tools, {})

    def reply_parser(self, tools: tuple[Tool, ...]) -> MuseParser:
        schemas = {t.name: t.parameters for t in tools}
        return MuseParser(self.new_id, frozenset(schemas), schemas)


class MuseParser(ReplyParser):
    """Messages one after another: a header read whole, then its body as content, as a call, or skipped. A call's
    body is read whole once it ends (its invoke is sent then)."""

    HEADER_MAX = 256

    def __init__(self, new_id, tools, schemas: dict[str, dict]):
        super().__init__(new_id, tools)
        self.schemas = schemas
        self.state = "header"
        self.to = "user"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "header":
                rest = self.text[self.cur :]
                k = rest.find(MESSAGE)
                head = _RECIPIENT.match(rest[:k]) if k != -1 else None
                if head is None:
                    looks = any(
                        h.startswith(rest.lstrip()[:9]) or rest.lstrip().startswith(h) for h in (START, "to=")
                    )
                    if not final and looks and len(rest) <= self.HEADER_MAX:
                        return out  # a header may be coming
                    self.to = "user"  # text without a header is the answer
                else:
                    self.to = head.group("to")
                    self.cur += k + len(MESSAGE)
                self.state = "body"
            if self.state == "body":
                hits = [(k, m) for m in ENDS if (k := self.text.find(m, self.cur)) != -1]
                k, marker = min(hits) if hits else (-1, "")
                end = (
                    k if k != -1 else len(self.text) - (0 if final else holdback(self.text[self.cur :], ENDS))
                )
                if self.to == "user":
                    out += self.content.add(self.text[self.cur : end])
                    self.cur = end
                elif self.to != "self" and (k != -1 or final):
                    out += self._calls(self.text[self.cur : end], cut=k == -1)
                    self.cur = end
                    if self.malformed:
                        return out
                elif self.to == "self":
                    self.cur = end
                if k == -1:
                    return out
                self.cur = k + (0 if marker == START else len(marker))
                self.state = "header"

    def _calls(self, body: str, cut: bool) -> list[Event]:
        """The calls of a message to a tool, read whole (the complete ones only, if the reply ended in it)."""
        inner = TaggedParser(lambda: "", self.tools, ATEM, self.schemas)
        inner.feed(body)
        inner.finish()
        done = [c for c in inner.calls if c.complete]
        if (inner.malformed or not done) and not (cut and inner.cut):
            self.malformed = True
            return []
        self.cut = self.cut or inner.cut
        out: list[Event] = []
        for c in done:
            out += self._whole_call(c.name, json.loads(c.arguments))
        return out
