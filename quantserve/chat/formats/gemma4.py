"""Gemma 4: `<|tool_call>call:NAME{key:value,…}<tool_call|>`, in a syntax of its own: keys bare, strings between
`<|"|>` markers, numbers, true, false and null as in JSON, lists in brackets and objects in braces. A call's
arguments are read whole once its closing brace comes and given to the client as the JSON they mean."""

from __future__ import annotations

import json
import re
from typing import Any

from quantserve.chat.formats import (
    TEXT_RULE,
    GrammarSpec,
    ToolFormat,
    calls_grammar,
    keyword_sequence,
    trigger_rule,
)
from quantserve.chat.reasoning import holdback
from quantserve.chat.reply import Event, ReplyParser
from quantserve.structured import Grammar, lark_literal, lark_text

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
# channel markers astray in an answer (a doubled opening, an empty thought block after the answer): dropped from
# it, as llama.cpp drops them (tests/test-chat.cpp)
STRAY = ("<|channel>thought\n<channel|>", "<|channel>", "<channel|>")
_NAME = re.compile(r"call:([^{\s<]+)\{")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_SO_FAR = re.compile(r"-?\d*(?:\.\d*)?(?:[eE][+-]?\d*)?")
_KEY = re.compile(r"\s*([^\s:{}\[\],<]+)\s*:")


class Incomplete(Exception):
    """The text ends before the value does."""


def read_value(text: str, i: int) -> tuple[Any, int]:
    """The value at text[i:] and where it ends.

    Raises:
        Incomplete: the text ends inside it.
        ValueError: it is not Gemma's syntax.
    """
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        raise Incomplete
    if text.startswith(QUOTE, i) or QUOTE.startswith(text[i:]):
        end = text.find(QUOTE, i + len(QUOTE))
        if end == -1:
            raise Incomplete
        return text[i + len(QUOTE) : end], end + len(QUOTE)
    if text[i] in "[{":
        close = "]" if text[i] == "[" else "}"
        out: Any = [] if close == "]" else {}
        i += 1
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            if i >= len(text):
                raise Incomplete
            if text[i] == close:
                return out, i + 1
            if out:
                if text[i] != ",":
                    raise ValueError(f"expected ',' at {i}")
                i += 1
            if close == "]":
                value, i = read_value(text, i)
                out.append(value)
            else:
                key = _KEY.match(text, i)
                if key is None:
                    if ":" not in text[i:]:
                        raise Incomplete
                    raise ValueError(f"expected a key at {i}")
                value, i = read_value(text, key.end())
                out[key.group(1)] = value
    for word, value in (("true", True), ("false", False), ("null", None)):
        if text.startswith(word, i):
            return value, i + len(word)
        if word.startswith(text[i:]):
            raise Incomplete
    if _NUMBER_SO_FAR.fullmatch(text, i):
        raise Incomplete  # a number the text may still go on writing ("-", "3.", "1.5e")
    number = _NUMBER.match(text, i)
    if number is None:
        raise ValueError(f"not a value at {i}")
    return json.loads(number.group(0)), number.end()


class Gemma4(ToolFormat):
    name = "gemma4"
    priority = 46
    markers = (OPEN,)
    frames = True  # for the stray markers

    def grammar(self, spec: GrammarSpec) -> Grammar:
        q = lark_text(QUOTE, spec.special)
        rules: dict[str, str] = {}
        calls = " | ".join(
            f'"call:" {lark_literal(t.name)} {_value(t.parameters, t.parameters, q, rules, f"t{i}")}'
            for i, t in enumerate(spec.tools)
        )
        more = "call*" if spec.parallel else ""
        body = [
            f"call: {lark_text(OPEN, spec.special)} body {lark_text(CLOSE, spec.special)}",
            f"body: {calls}",
            f"calls: call {more}",
            f"gstr[lazy]: {q} /(.|\\n)*/ {q}",
            'gval: gstr | /-?[0-9][0-9.eE+-]*/ | "true" | "false" | "null" | "[" (gval ("," gval)*)? "]" '
            '| "{" (/[A-Za-z_][A-Za-z0-9_]*/ ":" gval ("," /[A-Za-z_][A-Za-z0-9_]*/ ":" gval)*)? "}"',
            *(f"{name}: {rule}" for name, rule in rules.items()),
        ]
        tail = f"body {lark_text(CLOSE, spec.special)} {more}"
        free = f"%llguidance {{}}\nstart: TEXT | trig {tail}\n{trigger_rule(OPEN, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, "\n".join(body), free)

    def parser(self, tools: frozenset[str]) -> Gemma4Parser:
        return Gemma4Parser(self.new_id, tools)


def _value(
    schema: Any, root: dict[str, Any], q: str, rules: dict[str, str], name: str, depth: int = 0
) -> str:
    """Lark for one value of `schema` in Gemma's syntax (`root` holds the $defs its $refs point into); rules for
    objects and $refs are added to `rules` by name. What the syntax cannot say (a string's pattern, an integer's
    wide range) is left to the schema check after parsing."""
    if not isinstance(schema, dict) or depth > 8:
        return "gval"
    ref = schema.get("$ref")
    if isinstance(ref, str):
        key = ref.rpartition("/")[2]
        target = (root.get("$defs") or root.get("definitions") or {}).get(key)
        rule = "ref_" + re.sub(r"[^a-z0-9_]", "_", key.lower())
        if rule not in rules:
            rules[rule] = "gval"  # named before it is built, so that a recursive model refers to it
            rules[rule] = _value(target, root, q, rules, rule, depth + 1)
        return rule
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return "(" + " | ".join(_literal(c, q) for c in choices) + ")"
    kind = schema.get("type")
    if kind == "string":
        return "gstr"
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if isinstance(lo, int) and isinstance(hi, int) and 0 <= hi - lo <= 64:
            return "(" + " | ".join(f'"{n}"' for n in range(lo, hi + 1)) + ")"
        return "/-?(0|[1-9][0-9]*)/"
    if kind == "number":
        return "/-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/"
    if kind == "array":
        return _array(schema, root, q, rules, name, depth)
    if kind == "object" or "properties" in schema:
        return _object(schema, root, q, rules, name, depth)
    return "gval"


def _array(schema: dict[str, Any], root, q, rules, name: str, depth: int) -> str:
    item = _value(schema.get("items", {}), root, q, rules, f"{name}_i", depth + 1)
    lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
    if isinstance(hi, int) and hi <= 8:
        seqs = [' "," '.join([item] * n) for n in range(max(lo, 0), hi + 1)]
        return '"[" (' + " | ".join(x or '""' for x in seqs) + ') "]"'
    inner = f'{item} ("," {item})*'
    return f'"[" {inner} "]"' if lo >= 1 else f'"[" ({inner})? "]"'


def _object(schema: dict[str, Any], root, q, rules, name: str, depth: int) -> str:
    """The required properties in order, then any of the optional ones, in order."""
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    pair = {
        k: f'{lark_literal(k)} ":" {_value(props[k], root, q, rules, f"{name}_{j}", depth + 1)}'
        for j, k in enumerate(props)
    }
    body = keyword_sequence(pair, required, '","')
    rule = f"o_{name}"
    rules[rule] = f'"{{" {body} "}}"'
    return rule


def _literal(value: Any, q: str) -> str:
    if isinstance(value, str):
        return f"{q} {lark_literal(value)} {q}"
    return lark_literal(json.dumps(value))


class Gemma4Parser(ReplyParser):
    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "text"
        self.name = ""

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "text":
                events, marker = self._text_until_any((OPEN, *STRAY), final)
                out += events
                if marker is None:
                    return out
                self.cur += len(marker)
                if marker in STRAY:
                    continue
                self.state = "name"
            if self.state == "name":
                m = _NAME.match(self.text, self.cur)
                if m is None:
                    rest = self.text[self.cur :]
                    if (
                        final
                        or len(rest) > 256
                        or not ("call:".startswith(rest[:5]) or rest.startswith("call:"))
                    ):
                        self.cut = final and not self.malformed and rest.startswith("call:"[: len(rest)])
                        self.malformed = not self.cut
                    return out
                self.name = m.group(1)
                self.cur = m.end() - 1  # at the brace
                self.state = "args"
            if self.state == "args":
                try:
                    args, end = read_value(self.text, self.cur)
                except Incomplete:
                    self.cut = final
                    return out
                except ValueError:
                    self.malformed = True
                    return out
                out += self._whole_call(self.name, args)
                if self.malformed:
                    return out
                self.cur = end
                self.state = "close"
            if self.state == "close":
                rest = self.text[self.cur :]
                if rest.startswith(CLOSE):
                    self.cur += len(CLOSE)
                elif not final and holdback(rest, (CLOSE,)) == len(rest):
                    return out
                self.state = "text"
