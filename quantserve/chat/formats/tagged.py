"""The machinery of the formats that write each argument as a tagged value rather than JSON (the families are in
chat.formats.xmlcalls and chat.formats.xtml).

A value is text where the tool's schema says the parameter is a string (or the call's markup says so: DSML's
`string="true"`, Kimi K3's `type="string"`), and JSON otherwise (a number, an object), as the templates write them
(`tojson` for anything not a string). The arguments are then the JSON object of those values, sent as each value
is complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from quantserve.chat.formats import TEXT_RULE, GrammarSpec, ToolFormat, calls_grammar, trigger_rule
from quantserve.chat.reply import CallDelta, Event, ReplyParser, cut_char
from quantserve.chat.tools import Tool
from quantserve.structured import Grammar, json_rule, lark_literal, lark_text


@dataclass(frozen=True)
class Tags:
    """`section`: markers around the calls (None: each call stands alone). `start`: the text a call begins with;
    `call`: its opening, the tool's name as group "name"; `end`: its closing. `param`: a parameter's opening, its
    key as group "key" (and what the markup says of its type as group "string": DSML's `true|false`, Kimi K3's
    JSON type); `param_end`: its closing. `write_call`/`write_param`: how the grammar writes a call's opening
    ({name}, and {n} for its index) and a parameter's ({key}, {string}: true|false, {type}: its JSON type); `pad`:
    the text between parts. `dropped`: markers around the answer, dropped from its text (Kimi K3's sections)."""

    section: tuple[str, str] | None
    start: str
    call: re.Pattern[str]
    end: str
    param: re.Pattern[str]
    param_end: str
    write_call: str
    write_param: str
    pad: str = "\n"
    newlines: bool = False  # a value is written between newlines, which are not part of it (Qwen3-Coder)
    dropped: tuple[str, ...] = ()


class TaggedCall:
    """One call whose arguments are built from tagged values (the interface of reply.CallStream)."""

    def __init__(self, index: int, call_id: str, name: str, tools: frozenset[str]):
        self.index, self.id, self.name = index, call_id, name
        self.rejected = name not in tools
        self.started = False
        self.complete = False
        self.arguments = ""
        self._sent = 0
        self._values: dict[str, Any] = {}

    def add(self, key: str, value: Any) -> None:
        self._values[key] = value
        self.arguments = json.dumps(self._values, ensure_ascii=False)[:-1]  # still open

    def close(self) -> None:
        self.arguments = json.dumps(self._values, ensure_ascii=False)
        self.complete = True

    def poll(self) -> list[Event]:
        if self.rejected:
            return []
        out: list[Event] = []
        if not self.started:
            self.started = True
            out.append(CallDelta(self.index, id=self.id, name=self.name))
        if len(self.arguments) > self._sent:
            out.append(CallDelta(self.index, arguments=self.arguments[self._sent :]))
            self._sent = len(self.arguments)
        return out


CDATA = ("<![CDATA[", "]]>")


class Tagged(ToolFormat):
    """The format of one family of TAGS (a subclass per family sets it)."""

    tags: ClassVar[Tags]

    def grammar(self, spec: GrammarSpec) -> Grammar:
        t = self.tags
        pad = "/\\n?/" if t.pad else ""  # the newline between parts, which a model may leave out
        calls = " | ".join(f"c{i}" for i in range(len(spec.tools)))
        rules = [tool_rules(t, i, tool, spec, pad) for i, tool in enumerate(spec.tools)]
        more = f"({pad} call)*" if spec.parallel else ""
        rules.append(f"call: {calls}")
        if t.section is not None:
            open_, close = (lark_text(x, spec.special) for x in t.section)
            rules.append(f"rest: {pad} call {more} {pad} {close}\ncalls: {open_} rest")
            trigger, after = t.section[0], "rest"
        else:
            tails = " | ".join(f"t{i}" for i in range(len(spec.tools)))
            rules.append(f"tail: {tails}\ncalls: call {more}")
            trigger, after = t.start, f"tail {more}"
        free = f"%llguidance {{}}\nstart: TEXT | trig {after}\n{trigger_rule(trigger, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, "\n".join(rules), free)

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.tags.section[0], self.tags.start) if self.tags.section else (self.tags.start,)

    def parser(self, tools: frozenset[str]) -> TaggedParser:
        return TaggedParser(self.new_id, tools, self.tags, {})

    def reply_parser(self, tools: tuple[Tool, ...]) -> TaggedParser:
        """Values are typed by the tools' schemas: text for string parameters, JSON for the rest."""
        schemas = {t.name: t.parameters for t in tools}
        return TaggedParser(self.new_id, frozenset(schemas), self.tags, schemas)


def tool_rules(t: Tags, i: int, tool: Tool, spec: GrammarSpec, pad: str) -> str:
    """c{i}: a whole call of `tool`; t{i}: the same after its start (what a trigger on the start leaves)."""
    params = tool.parameters
    props: dict[str, Any] = params.get("properties") or {}
    # each value is its own JSON document: it takes the tool's definitions along, for its $refs
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    required = set(params.get("required") or ())
    opening = t.write_call.format(name=tool.name, n="\0")
    parts, rules = [], []
    for j, (key, prop) in enumerate(props.items()):
        flag = "true" if _is_string(prop) else "false"  # DSML says which values are text
        head = lark_text(t.write_param.format(key=key, string=flag, type=_json_type(prop)), spec.special)
        close = lark_text(t.param_end, spec.special)
        choices = (
            prop.get("enum", [prop["const"]] if "const" in prop else None) if isinstance(prop, dict) else None
        )
        if _is_string(prop) and choices and all(isinstance(c, str) for c in choices):
            body = "(" + " | ".join(lark_literal(c) for c in choices) + f") {close}"
        elif _is_string(prop):  # text up to the closing tag (its first appearance)
            rules.append(f"v{i}_{j}[lazy]: /(.|\\n)*/ {close}")
            body = f"v{i}_{j}"
        else:
            body = f"{json_rule({**prop, **defs})} {close}"
        parts.append(f"({pad} {head} {body})" + ("" if key in required else "?"))
    end = lark_text(t.end, spec.special)
    tail = f"{' '.join(parts)} {pad} {end}"
    rules.append(f"c{i}: {_opening(opening, spec)} {tail}")
    rules.append(f"t{i}: {_opening(opening.removeprefix(t.start), spec)} {tail}")
    return "\n".join(rules)


def _opening(text: str, spec: GrammarSpec) -> str:
    """Lark for a call's opening, its index ("\0") written as a number."""
    head, mark, tail = text.partition("\0")
    return lark_text(head, spec.special) + (
        f" /[0-9]{{1,2}}/ {lark_text(tail, spec.special)}" if mark else ""
    )


def _json_type(prop: Any) -> str:
    """The JSON type a parameter's schema gives its values (Kimi K3 writes it): string where it names none."""
    kind = prop.get("type") if isinstance(prop, dict) else None
    kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if k not in (None, "null")]
    if not kinds or _is_string(prop):
        return "string"
    return "number" if kinds[0] == "integer" else str(kinds[0])


def _is_string(prop: Any) -> bool:
    kind = prop.get("type") if isinstance(prop, dict) else None
    return kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1)


class TaggedParser(ReplyParser):
    """Text, then calls: each opening read whole, then its tagged values one by one."""

    OPEN_MAX = 512  # an opening longer than this without matching is not one

    def __init__(self, new_id: Callable[[], str], tools, tags: Tags, schemas: dict[str, dict]):
        super().__init__(new_id, tools)
        self.t = tags
        self.schemas = schemas
        self.state = "text"
        self.key: str | None = None
        self.string: bool | None = None

    def _value(self, name: str, key: str, raw: str) -> Any:
        """A tagged value: text for a string parameter, else the JSON it is (or the text, if it is none)."""
        if self.t.newlines:
            raw = raw.removeprefix("\n").removesuffix("\n")
        if raw.startswith(CDATA[0]) and raw.endswith(CDATA[1]):
            raw = raw[len(CDATA[0]) : -len(CDATA[1])]
        prop = ((self.schemas.get(name) or {}).get("properties") or {}).get(key)
        as_text = self.string if self.string is not None else (prop is None or _is_string(prop))
        if as_text:
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        t = self.t
        while True:
            if self.state == "text":
                markers = (t.section[0], t.start) if t.section is not None else (t.start,)
                events, marker = self._text_until_any((*markers, *t.dropped), final)
                out += events
                if marker is None:
                    return out
                if marker in t.dropped:
                    self.cur += len(marker)
                    continue
                if marker == t.start:
                    self.state = "open"  # the start is part of the call's opening
                else:
                    self.cur, self.state = self.cur + len(marker), "section"
            if self.state == "section":
                assert t.section is not None
                rest = self.text[self.cur :].lstrip()
                at = len(self.text) - len(rest)
                if rest.startswith(t.section[1]):
                    self.cur, self.state = at + len(t.section[1]), "text"
                    continue
                if rest.startswith(t.start):
                    self.cur, self.state = at, "open"
                elif any(m.startswith(cut_char(rest)) for m in (t.section[1], t.start)):
                    self.cut = final and bool(rest)  # the reply ended in a marker's first characters
                    return out
                else:
                    self.malformed = True  # something else inside the section
                    return out
            if self.state == "open":
                m = t.call.match(self.text, self.cur)
                if m is None:
                    if final or len(self.text) - self.cur > self.OPEN_MAX:
                        self.cut = final and not self.malformed and len(self.text) - self.cur <= self.OPEN_MAX
                        self.malformed = not self.cut
                    return out
                call = TaggedCall(len(self.calls), self.new_id(), m.group("name").strip(), self.tools)
                self.calls.append(call)
                out += call.poll()
                if call.rejected:
                    self.malformed = True
                    self.state = "junk"
                    return out
                self.cur = m.end()
                self.state = "params"
            if self.state == "params":
                rest = self.text[self.cur :].lstrip()
                at = len(self.text) - len(rest)
                if rest.startswith(t.end):
                    self.calls[-1].close()
                    out += self.calls[-1].poll()
                    self.cur = at + len(t.end)
                    self.state = "section" if t.section is not None else "text"
                    continue
                m = t.param.match(self.text, at)
                if m is None:
                    if final:
                        self.cut = True
                    elif len(rest) > self.OPEN_MAX or not (
                        t.end.startswith(rest) or rest.startswith(t.param.pattern[:1]) or not rest
                    ):
                        self.malformed = True
                    return out
                self.key = m.group("key").strip()
                flag = m.groupdict().get("string")
                self.string = None if flag is None else flag in ("true", "string")
                self.cur = m.end()
                self.state = "value"
            if self.state == "value":
                after = self.cur
                if self.text.startswith(CDATA[0], self.cur):  # a value in CDATA may hold the closing tag
                    end = self.text.find(CDATA[1], self.cur)
                    if end == -1:
                        self.cut = final
                        return out
                    after = end
                k = self.text.find(t.param_end, after)
                if k == -1:
                    self.cut = final
                    return out
                call = self.calls[-1]
                assert self.key is not None
                call.add(self.key, self._value(call.name, self.key, self.text[self.cur : k]))
                out += call.poll()
                self.cur = k + len(t.param_end)
                self.state = "params"
            if self.state == "junk":
                return out


def tags_of(section, start, call, end, param, param_end, write_call, write_param, **kw: Any) -> Tags:
    """Tags, its two patterns compiled."""
    return Tags(
        section, start, re.compile(call), end, re.compile(param), param_end, write_call, write_param, **kw
    )
