"""Families that write each argument as a tagged value rather than JSON:

| family | a call looks like |
|---|---|
| Qwen3-Coder, Qwen3.5, Nemotron 3, StepFun | `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` |
| Seed-OSS | the same inside `<seed:tool_call>…</seed:tool_call>` |
| MiniMax M2 | `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n</invoke>…` |
| GLM 4.5-4.7, Ling, Laguna, Spark | `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>` |
| DeepSeek V3.2 / V4 (DSML) | `<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="KEY" string="true">VALUE</…>` |
| Hunyuan 3 | `<tool_call:opensource>NAME<tool_sep:opensource>\\n<arg_key:opensource>KEY</…><arg_value:opensource>…` |
| MiniCPM 5 | `<function name="NAME"><param name="KEY">VALUE</param></function>` |

A value is text where the tool's schema says the parameter is a string (or DSML says `string="true"`), and JSON
otherwise (a number, an object), as the templates write them (`tojson` for anything not a string). The arguments
are then the JSON object of those values, sent as each value is complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from quantserve.chat.formats import TEXT_RULE, GrammarSpec, ToolFormat, calls_grammar, trigger_rule
from quantserve.chat.reply import CallDelta, Event, ReplyParser, cut_char
from quantserve.chat.tools import Tool
from quantserve.structured import Grammar, json_rule, lark_literal, lark_text


@dataclass(frozen=True)
class Tags:
    """`section`: markers around the calls (None: each call stands alone). `start`: the text a call begins with;
    `call`: its opening, the tool's name as group "name"; `end`: its closing. `param`: a parameter's opening, its
    key as group "key" (and DSML's `string="true|false"` as group "string"); `param_end`: its closing. `write`:
    how the grammar writes a call's opening and a parameter's ({name}, {key}); `pad`: the text between parts."""

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
        rules = [_tool_rules(t, i, tool, spec, pad) for i, tool in enumerate(spec.tools)]
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


def _tool_rules(t: Tags, i: int, tool: Tool, spec: GrammarSpec, pad: str) -> str:
    """c{i}: a whole call of `tool`; t{i}: the same after its start (what a trigger on the start leaves)."""
    params = tool.parameters
    props: dict[str, Any] = params.get("properties") or {}
    # each value is its own JSON document: it takes the tool's definitions along, for its $refs
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    required = set(params.get("required") or ())
    opening = t.write_call.format(name=tool.name)
    parts, rules = [], []
    for j, (key, prop) in enumerate(props.items()):
        flag = "true" if _is_string(prop) else "false"  # DSML says which values are text
        head = lark_text(t.write_param.format(key=key, string=flag), spec.special)
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
    rules.append(f"c{i}: {lark_text(opening, spec.special)} {tail}")
    rules.append(f"t{i}: {lark_text(opening.removeprefix(t.start), spec.special)} {tail}")
    return "\n".join(rules)


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
                events, marker = self._text_until_any(markers, final)
                out += events
                if marker is None:
                    return out
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
                self.string = None if flag is None else flag == "true"
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


def _tags(
    section, start, call, end, param, param_end, write_call, write_param, pad="\n", newlines=False
) -> Tags:
    call_re, param_re = re.compile(call), re.compile(param)
    return Tags(section, start, call_re, end, param_re, param_end, write_call, write_param, pad, newlines)


class Qwen3Coder(Tagged):
    name = "qwen3-coder"
    priority = 50
    tags = _tags(
        ("<tool_call>", "</tool_call>"),
        "<function=",
        r"<function=(?P<name>[^>\n]+)>",
        "</function>",
        r"<parameter=(?P<key>[^>\n]+)>",
        "</parameter>",
        "<function={name}>",
        "<parameter={key}>",
        newlines=True,
    )


class SeedOss(Tagged):
    name = "seed-oss"
    priority = 51
    tags = _tags(
        ("<seed:tool_call>", "</seed:tool_call>"),
        "<function=",
        r"<function=(?P<name>[^>\n]+)>",
        "</function>",
        r"<parameter=(?P<key>[^>\n]+)>",
        "</parameter>",
        "<function={name}>",
        "<parameter={key}>",
    )


class MiniMaxM2(Tagged):
    name = "minimax-m2"
    priority = 52
    tags = _tags(
        ("<minimax:tool_call>", "</minimax:tool_call>"),
        "<invoke name=",
        r'<invoke name="(?P<name>[^"]+)">',
        "</invoke>",
        r'<parameter name="(?P<key>[^"]+)">',
        "</parameter>",
        '<invoke name="{name}">',
        '<parameter name="{key}">',
    )


class Glm(Tagged):
    name = "glm"
    priority = 53
    tags = _tags(
        None,
        "<tool_call>",
        r"<tool_call>\s*(?P<name>[^<\s]+)\s*(?=<arg_key>|</tool_call>)",
        "</tool_call>",
        r"<arg_key>(?P<key>[^<]+)</arg_key>\s*<arg_value>",
        "</arg_value>",
        "<tool_call>{name}",
        "<arg_key>{key}</arg_key><arg_value>",
    )


class DsmlV32(Tagged):
    name = "deepseek-v3.2"
    priority = 54
    tags = _tags(
        ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
        "<｜DSML｜invoke name=",
        r'<｜DSML｜invoke name="(?P<name>[^"]+)">',
        "</｜DSML｜invoke>",
        r'<｜DSML｜parameter name="(?P<key>[^"]+)"(?: string="(?P<string>true|false)")?>',
        "</｜DSML｜parameter>",
        '<｜DSML｜invoke name="{name}">',
        '<｜DSML｜parameter name="{key}" string="{string}">',
    )


class DsmlV4(Tagged):
    name = "deepseek-v4"
    priority = 55
    tags = replace(DsmlV32.tags, section=("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"))


class Hunyuan(Tagged):
    name = "hunyuan"
    priority = 56
    tags = _tags(
        ("<tool_calls:opensource>", "</tool_calls:opensource>"),
        "<tool_call:opensource>",
        r"<tool_call:opensource>(?P<name>[^<]+)<tool_sep:opensource>",
        "</tool_call:opensource>",
        r"<arg_key:opensource>(?P<key>[^<]+)</arg_key:opensource>\s*<arg_value:opensource>",
        "</arg_value:opensource>",
        "<tool_call:opensource>{name}<tool_sep:opensource>",
        "<arg_key:opensource>{key}</arg_key:opensource>\n<arg_value:opensource>",
    )


class MiniCpm(Tagged):
    name = "minicpm"
    priority = 57
    tags = _tags(
        None,
        "<function name=",
        r'<function name="(?P<name>[^"]+)">',
        "</function>",
        r'<param name="(?P<key>[^"]+)">',
        "</param>",
        '<function name="{name}">',
        '<param name="{key}">',
        pad="",
    )
