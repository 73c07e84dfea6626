"""gpt-oss's harmony format: a reply is a run of messages, each a header and a body,

    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>

(the generation prompt already wrote the first `<|start|>assistant`). A call is a message to `functions.NAME`,
its body the arguments' JSON, ended by `<|call|>`; the answer is the body of the `final` channel (or of
`commentary` without a recipient); the `analysis` channel is reasoning (quantserve.chat.reasoning splits the first
one off; a later one is dropped from the answer). Recipients other than `functions.*` (the built-in `python` and
`browser` tools) are not calls of the request's tools, and their messages are dropped too.
"""

from __future__ import annotations

import re

from quantserve.chat.formats import TEXT_RULE, GrammarSpec, ToolFormat, calls_grammar, trigger_rule
from quantserve.chat.reasoning import holdback
from quantserve.chat.reply import Event, JsonCallParser
from quantserve.structured import Grammar, json_rule, lark_literal, lark_text

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADS = (START, CHANNEL, " to=", "to=", CONSTRAIN, "assistant")  # what a message's header may begin with
CALL_HEAD = " to=functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class Harmony(ToolFormat):
    name = "harmony"
    priority = 45
    frames = True
    markers = (CALL_HEAD, START)

    def grammar(self, spec: GrammarSpec) -> Grammar:
        """Calls as the template writes them: ` to=functions.NAME<|channel|>commentary json<|message|>{…}`, a
        further one after `<|call|><|start|>assistant`. The name and its arguments go together, a rule per tool."""
        lit = spec.literal

        def after_to(t) -> str:
            head = f'{lark_literal(t.name)} {lit(CHANNEL)} "commentary json" {lit(MESSAGE)}'
            return f"{head} {json_rule(t.parameters)}"

        tails = " | ".join(after_to(t) for t in spec.tools)
        again = f'{lark_text(ENDS[1], spec.special)}? {lit(START)} "assistant"'
        more = f"({again} call)*" if spec.parallel else ""
        rules = f'call: " to=functions." tail\ntail: {tails}\ncalls: call {more}'
        free = (
            f"%llguidance {{}}\nstart: TEXT | trig tail {more}\n{trigger_rule(CALL_HEAD, spec)}\n{TEXT_RULE}"
        )
        return calls_grammar(spec, rules, free)

    def parser(self, tools: frozenset[str]) -> HarmonyParser:
        return HarmonyParser(self.new_id, tools)


class HarmonyParser(JsonCallParser):
    """Messages one after another: a header read whole, then its body as content, as a call's JSON, or
    skipped."""

    HEADER_MAX = 256

    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "message"
        self.body = "content"  # what the current body is: content, call or skip

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "message":  # a header, or plain text (a reply written without one)
                rest = self.text[self.cur :]
                if not rest:
                    return out
                stripped = rest.lstrip()
                if not stripped.startswith(HEADS) and not any(h.startswith(stripped) for h in HEADS):
                    self.state = "body"
                    self.body = "content"
                    continue
                k = self.text.find(MESSAGE, self.cur)
                if k == -1:
                    if final:
                        self.cut = any(c.started for c in self.calls) or "to=functions." in rest
                        if not self.cut:
                            out += self.content.add(rest)  # a header never finished: its text is what it is
                            self.cur = len(self.text)
                    elif len(rest) > self.HEADER_MAX:
                        self.malformed = True
                    return out
                header = self.text[self.cur : k]
                self.cur = k + len(MESSAGE)
                # a header written twice over (`commentary to=assistant<|channel|>final`, which llama.cpp reads as
                # its last channel): the last channel counts, and the assistant is no recipient
                recipient = next((m for m in _RECIPIENT.finditer(header) if m.group(1) != "assistant"), None)
                channel = ([None, *_CHANNEL.finditer(header)])[-1]
                if recipient is not None and recipient.group(1).startswith("functions."):
                    name = recipient.group(1).removeprefix("functions.")
                    self._call(self._scan(self.cur), (), name=name)
                    self.state = "args"
                else:
                    kind = channel.group(1) if channel else "final"
                    self.body = "skip" if recipient is not None or kind == "analysis" else "content"
                    self.state = "body"
            if self.state == "body":
                # a body ends at its end marker, or where the next message begins: <|start|>, or a call's header
                # written straight after text (what the grammar lets a reply in words do)
                stops = (*ENDS, START, CALL_HEAD) if self.body == "content" else (*ENDS, START)
                hits = [(k, m) for m in stops if (k := self.text.find(m, self.cur)) != -1]
                k, marker = min(hits) if hits else (-1, "")
                held = 0 if final else holdback(self.text[self.cur :], stops)
                end = k if k != -1 else len(self.text) - held
                if self.body == "content":
                    out += self.content.add(self.text[self.cur : end])
                self.cur = end
                if k == -1:
                    return out
                self.cur = k + (0 if marker == CALL_HEAD else len(marker))  # the role begins the next header
                self.state = "message"
            if self.state == "args":
                if not self._read_args(final, out):
                    return out
                rest = self.text[self.cur :].lstrip()
                for marker in ENDS:
                    if rest.startswith(marker):
                        self.cur = len(self.text) - len(rest) + len(marker)
                        break
                else:
                    if not final and any(m.startswith(rest) for m in ENDS) and rest:
                        return out
                self.state = "message"
            if self.state == "junk":
                return out
