"""Mistral: `[TOOL_CALLS]` then the calls. Two generations of templates, told apart by the probe:
Nemo writes a JSON array `[{"name": …, "arguments": {…}, "id": …}]`; v11 and later (Small 3.2, Devstral,
Ministral) write `name[ARGS]{…}` per call, Small 3.2 with `[CALL_ID]id` between. Call ids are 9 letters and
digits, which the templates check."""

from __future__ import annotations

import hashlib
import re
import string

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
from quantserve.chat.template import TemplateProbe
from quantserve.chat.tools import new_call_id
from quantserve.structured import Grammar, json_rule, lark_literal

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = string.ascii_letters + string.digits


def nine_char_id(call_id: str) -> str:
    """A client's call id as the 9 letters and digits Mistral's templates demand (the same id, the same result)."""
    if _ID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(n >> (6 * i)) % len(_ALNUM)] for i in range(9))


class Mistral(ToolFormat):
    name = "mistral"
    priority = 10

    def __init__(self, probe: TemplateProbe):
        super().__init__(probe)
        turn = probe.turn or ""
        self.json_array = ARGS not in turn  # Nemo
        self.call_ids = CALL_ID in turn  # Small 3.2

    def prepare(self, messages, tools, choice, parallel):
        out, extra = super().prepare(messages, tools, choice, parallel)
        fixed = []
        for m in out:
            if m.get("tool_calls"):
                m = {
                    **m,
                    "tool_calls": [{**c, "id": nine_char_id(str(c.get("id", "")))} for c in m["tool_calls"]],
                }
            if m.get("role") == "tool" and "tool_call_id" in m:
                m = {**m, "tool_call_id": nine_char_id(str(m["tool_call_id"]))}
            fixed.append(m)
        return fixed, extra

    def grammar(self, spec: GrammarSpec) -> Grammar:
        tc = spec.literal(TOOL_CALLS)
        if self.json_array:
            ident = {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}
            call = json_rule(one_of([call_schema(t, **ident) for t in spec.tools]))
            more = ' (", " call)*' if spec.parallel else ""
            rules = f'call: {call}\nrest: "[" call{more} "]"\ncalls: {tc} rest'
            follow = ""  # one [TOOL_CALLS] holds them all
        else:
            ident = f" {spec.literal(CALL_ID)} /[a-zA-Z0-9]{{9}}/" if self.call_ids else ""
            args = spec.literal(ARGS)
            alts = " | ".join(
                f"{lark_literal(t.name)}{ident} {args} {json_rule(t.parameters)}" for t in spec.tools
            )
            follow = f" ({tc} rest)*" if spec.parallel else ""  # [TOOL_CALLS] before each call
            rules = f"rest: {alts}\ncalls: {tc} rest{follow}"
        free = f"%llguidance {{}}\nstart: TEXT | trig rest{follow}\n{trigger_rule(TOOL_CALLS, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, rules, free)

    markers = (TOOL_CALLS,)

    def parser(self, tools: frozenset[str]) -> MistralParser:
        return MistralParser(self.new_id, tools)

    def new_id(self) -> str:
        return new_call_id(9, prefix="")


class MistralParser(JsonCallParser):
    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "text"
        self.name = self.id = ""

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "junk":  # after a malformed call
                return out
            if self.state == "text":
                events, found = self._text_until(TOOL_CALLS, final)
                out += events
                if not found:
                    return out
                self.state = "open"
            if self.state == "open":
                rest = self.text[self.cur :].lstrip()
                if not rest:
                    self.cut = final
                    return out
                self.cur = len(self.text) - len(rest)
                if rest[0] == "[":  # Nemo: a JSON array of calls
                    self._scan(self.cur)
                    self.state = "array"
                else:
                    self.state = "name"
            if self.state == "array":
                sc = self._advance(final)
                while (len(self.calls),) in sc.spans:
                    self._call(sc, (len(self.calls),), whole=True)
                for call in self.calls:
                    out += call.poll()
                    if call.rejected:  # nothing after a call to no tool is read
                        self.malformed, self.state = True, "junk"
                        return out
                    written = sc.string_value((call.index, "id"))  # Nemo writes each call's id in its object
                    if written is not None and _ID.fullmatch(written):
                        call.id = written
                if sc.error:
                    self.malformed, self.state = True, "junk"
                    return out
                if not sc.done:
                    return out
                self.cur = self._scan_end()
                self.state = "text"
                continue
            if self.state in ("name", "id"):
                stops = (ARGS, CALL_ID) if self.state == "name" else (ARGS,)
                found = [(k, m) for m in stops if (k := self.text.find(m, self.cur)) != -1]
                if not found:
                    self.cut = final
                    return out
                k, marker = min(found)
                value = self.text[self.cur : k].strip()
                if self.state == "name":
                    self.name, self.id = value, ""
                else:
                    self.id = value
                self.cur = k + len(marker)
                self.state = "id" if marker == CALL_ID else "args"
            if self.state == "args":
                call_id = self.id if _ID.fullmatch(self.id) else ""
                self._call(self._scan(self.cur), (), name=self.name, call_id=call_id)
                self.state = "argscan"
            if self.state == "argscan":
                if not self._read_args(final, out):
                    return out
                self.state = "text"
