"""MiniMax M3: calls as namespaced XML whose tags are the arguments' own keys, every tag led by the namespace
token `]<]minimax[>[` (written NS here):

    NS<tool_call>\\nNS<invoke name="NAME">NS<city>Paris NS</city>NS<tags>NS<item>a NS</item>NS</tags>NS</invoke>\\n
    NS</tool_call>

(without the spaces). An object is its keys' elements, an array its `item` elements, a string its text as written,
and any other scalar its JSON. Which of these a value is comes from the tool's schema: where the schema allows a
string, the text is that string, markup and all; otherwise elements make an object (or, all `item`, an array), and
bare text is read as JSON. That is how the template writes arguments (its to_xml macro), and how llama.cpp reads
them back (tests/test-chat.cpp). A call's arguments are sent once its `invoke` closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from quantserve.chat.formats import TEXT_RULE, GrammarSpec, ToolFormat, calls_grammar, trigger_rule
from quantserve.chat.reply import Event, ReplyParser, cut_char
from quantserve.chat.tools import Tool
from quantserve.structured import Grammar, json_rule, lark_literal, lark_text

NS = "]<]minimax[>["
OPEN, CLOSE = f"{NS}<tool_call>", f"{NS}</tool_call>"
INVOKE, INVOKE_END = f'{NS}<invoke name="', f"{NS}</invoke>"
_INVOKE = re.compile(re.escape(INVOKE) + r'(?P<name>[^"]+)">')
_TAG = re.compile(re.escape(NS) + r"<(/?)([^<>/\s]+)>")
DEPTH = 8  # nesting beyond this is written (and read) as text


class MiniMaxM3(ToolFormat):
    name = "minimax-m3"
    priority = 59
    markers = (OPEN,)

    def grammar(self, spec: GrammarSpec) -> Grammar:
        rules: list[str] = []
        calls = []
        for i, tool in enumerate(spec.tools):
            head = lark_text(f'{INVOKE}{tool.name}">', spec.special)
            body = _object_rule(tool.parameters, _defs(tool.parameters), spec, rules, f"c{i}", 0)
            calls.append(f"{head} {body} {lark_text(INVOKE_END, spec.special)}")
        more = '("\\n" call)*' if spec.parallel else ""
        rules.append(f"call: {' | '.join(calls)}")
        rules.append(f'rest: "\\n" call {more} "\\n" {lark_text(CLOSE, spec.special)}')
        rules.append(f"calls: {lark_text(OPEN, spec.special)} rest")
        free = f"%llguidance {{}}\nstart: TEXT | trig rest\n{trigger_rule(OPEN, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, "\n".join(rules), free)

    def parser(self, tools: frozenset[str]) -> MiniMaxM3Parser:
        return MiniMaxM3Parser(self.new_id, tools, {})

    def reply_parser(self, tools: tuple[Tool, ...]) -> MiniMaxM3Parser:
        schemas = {t.name: t.parameters for t in tools}
        return MiniMaxM3Parser(self.new_id, frozenset(schemas), schemas)


# ---- the grammar: a value's XML by its schema ------------------------------------------------------------


def _defs(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema.get("definitions", {}), **schema.get("$defs", {})}


def _resolved(schema: Any, defs: dict[str, Any], hops: int = 0) -> dict[str, Any]:
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and hops < DEPTH:
        return _resolved(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs, hops + 1)
    return schema if isinstance(schema, dict) and "$ref" not in schema else {}


def _alternatives(schema: Any, defs: dict[str, Any], depth: int = 0) -> list[dict[str, Any]]:
    """The schemas a value may follow (anyOf/oneOf flattened, `$ref`s resolved; a schema that refers back to
    itself without end is any value)."""
    s = _resolved(schema, defs)
    alts = s.get("anyOf") or s.get("oneOf")
    if alts and depth < DEPTH:
        return [a for alt in alts for a in _alternatives(alt, defs, depth + 1)]
    if alts:
        return [{}]
    kinds = s.get("type")
    if isinstance(kinds, list):
        return [{**s, "type": k} for k in kinds]
    return [s]


def _object_rule(schema, defs, spec, rules, name, depth) -> str:
    """Lark for an object's elements: the required keys in order, each optional one where it stands."""
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for j, (key, prop) in enumerate(props.items()):
        body = _value_rule(prop, defs, spec, rules, f"{name}_{j}", depth + 1, f"{NS}</{key}>")
        parts.append(f"({lark_text(f'{NS}<{key}>', spec.special)} {body})" + ("" if key in required else "?"))
    return " ".join(parts) or '""'


def _value_rule(schema, defs, spec, rules, name, depth, close) -> str:
    """Lark for one value and the closing tag `close` that ends it."""
    end = lark_text(close, spec.special)
    alts = _alternatives(schema, defs)
    if depth > DEPTH or any(
        a.get("type") == "string" or not (a.get("type") or "properties" in a) for a in alts
    ):
        choices = [c for a in alts for c in a.get("enum", [a["const"]] if "const" in a else [])]
        if (
            all(a.get("type") == "string" for a in alts)
            and choices
            and all(isinstance(c, str) for c in choices)
        ):
            return "(" + " | ".join(lark_literal(c) for c in choices) + f") {end}"
        rules.append(f"{name}[lazy]: /(.|\\n)*/ {end}")  # any text, up to the closing tag's first appearance
        return name
    out = []
    for k, alt in enumerate(alts):
        if alt.get("type") == "object" or "properties" in alt:
            out.append(_object_rule(alt, defs, spec, rules, f"{name}o{k}", depth))
        elif alt.get("type") == "array":
            item = _value_rule(
                alt.get("items") or {}, defs, spec, rules, f"{name}a{k}", depth + 1, f"{NS}</item>"
            )
            out.append(f"({lark_text(f'{NS}<item>', spec.special)} {item})*")
        else:
            out.append(json_rule({**alt, **({"$defs": defs} if defs else {})}))
    return "(" + " | ".join(f"({o})" for o in out) + f") {end}"


# ---- reading ----------------------------------------------------------------------------------------------


def elements(text: str) -> list[tuple[str, str]] | None:
    """The elements `text` is a run of, as (key, inner text) pairs (none for blank text); None if it is not one
    (it is text)."""
    out, at = [], 0
    while text[at:].strip():
        m = _TAG.match(text, len(text) - len(text[at:].lstrip()))
        if m is None or m.group(1):
            return None
        key, depth = m.group(2), 1
        for t in _TAG.finditer(text, m.end()):
            if t.group(2) == key:
                depth += -1 if t.group(1) else 1
                if depth == 0:
                    out.append((key, text[m.end() : t.start()]))
                    at = t.end()
                    break
        else:
            return None
    return out


def decode(text: str, schema: Any, defs: dict[str, Any], depth: int = 0) -> Any:
    """A value's text read by its schema (see the module's docstring)."""
    alts = _alternatives(schema, defs) if schema else []
    if alts and any(a.get("type") == "string" for a in alts):
        return text
    parts = elements(text) if depth <= DEPTH else None
    arrays = [a for a in alts if a.get("type") == "array"]
    objects = [a for a in alts if a.get("type") == "object" or "properties" in a]
    if parts is None or not (parts or arrays or objects):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    if all(k == "item" for k, _ in parts) and (arrays or not objects):
        items = arrays[0].get("items") if arrays else None
        return [decode(v, items, defs, depth + 1) for _, v in parts]
    props = (objects[0].get("properties") or {}) if objects else {}
    return {k: decode(v, props.get(k), defs, depth + 1) for k, v in parts}


class MiniMaxM3Parser(ReplyParser):
    """Text, then the section of calls: each `invoke` read whole once it closes."""

    OPEN_MAX = 512

    def __init__(self, new_id, tools, schemas: dict[str, dict]):
        super().__init__(new_id, tools)
        self.schemas = schemas
        self.state = "text"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "text":
                events, found = self._text_until(OPEN, final)
                out += events
                if not found:
                    return out
                self.state = "section"
            if self.state == "section":
                rest = self.text[self.cur :].lstrip()
                at = len(self.text) - len(rest)
                if rest.startswith(CLOSE):
                    self.cur, self.state = at + len(CLOSE), "text"
                    continue
                if not rest.startswith(INVOKE):
                    if not any(m.startswith(cut_char(rest)) for m in (CLOSE, INVOKE)):
                        self.malformed = True  # something else inside the section
                    else:
                        self.cut = final and bool(rest)
                    return out
                m = _INVOKE.match(self.text, at)
                end = self.text.find(INVOKE_END, at)
                if m is None or end == -1:
                    self.cut = final
                    self.malformed = not final and m is None and len(rest) > self.OPEN_MAX
                    return out
                name = m.group("name")
                schema = self.schemas.get(name) or {}
                args = decode(self.text[m.end() : end], schema or {"type": "object"}, _defs(schema))
                if not isinstance(args, dict):
                    self.malformed = True
                    return out
                out += self._whole_call(name, args)
                if self.malformed:
                    return out
                self.cur = end + len(INVOKE_END)
