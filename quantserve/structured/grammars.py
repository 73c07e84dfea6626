"""Grammars for constrained decoding, in llguidance's serialized form: JSON schemas, and Lark for tool calls.

JSON is generated in the spacing Python's json.dumps and the chat templates' `tojson` use (", " and ": ", no other
whitespace): it is what models were trained to read and write, and a weak model that may not add whitespace cannot
ramble on in it until max_tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance

from quantserve.errors import InvalidRequestError

# llguidance's JSON compiler options (its "x-guidance" schema key). lenient: a keyword it cannot enforce (an
# OpenAPI `format` such as int32) is left out of the grammar instead of failing the request; tool calls are
# validated against the full schema afterwards anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
_LIFTED = "x-quantserve-defs"  # definitions of an embedded schema, on their way to the root (see embeddable)


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's serialized form, and the request field it came from (named in errors)."""

    source: str
    param: str
    prefix: str = ""  # text already written (a prefill the reply continues): a Guide starts past it


def check(grammar: Grammar) -> Grammar:
    """`grammar` if llguidance can build it.

    Raises:
        InvalidRequestError: naming grammar.param, with llguidance's reason.
    """
    error = llguidance.LLMatcher.validate_grammar(grammar.source)
    if error:
        raise InvalidRequestError(f"'{grammar.param}' cannot be enforced: {error}", param=grammar.param)
    return grammar


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    schema = _hoist(schema)
    return {**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


def embeddable(schema: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`schema` made fit to sit inside a larger one: a `$ref` resolves against the root of the whole document, so
    its `$defs` (or `definitions`) are renamed `prefix + name`, its references rewritten to match, and the
    definitions carried along to be moved to the root when the grammar is made. Pydantic and zod write nested
    models this way, so every tool schema goes through here."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not defs:
        return schema
    renamed = {name: prefix + name for name in defs}

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k != "$ref"}
        ref = node.get("$ref")
        if isinstance(ref, str):
            for base in ("#/$defs/", "#/definitions/"):
                head, _, rest = ref.removeprefix(base).partition("/")
                name = head.replace("~1", "/").replace("~0", "~")
                if ref.startswith(base) and name in renamed:
                    new = renamed[name].replace("~", "~0").replace("/", "~1")
                    ref = f"#/$defs/{new}" + (f"/{rest}" if rest else "")
                    break
            out["$ref"] = ref
        return out

    body = rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    body[_LIFTED] = {renamed[name]: rewrite(d) for name, d in defs.items()}
    return body


def _hoist(schema: dict[str, Any]) -> dict[str, Any]:
    """The definitions `embeddable` carried into a schema, moved to its root's $defs."""
    found: dict[str, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        for name, d in (node.get(_LIFTED) or {}).items():
            found[name] = walk(d)
        return {k: walk(v) for k, v in node.items() if k != _LIFTED}

    out = walk(schema)
    if found:
        out["$defs"] = {**(out.get("$defs") or {}), **found}
    return out


def json_schema_grammar(schema: dict[str, Any] | bool, *, param: str) -> Grammar:
    """The output is one JSON value matching `schema` (True or {} for any JSON object-or-value).

    Raises:
        InvalidRequestError: the schema is not a JSON object (deeper problems surface when a Guide is made).
    """
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"the JSON schema in '{param}' must be an object", param=param)
    try:
        return Grammar(llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema)), param)
    except ValueError as exc:
        raise InvalidRequestError(f"the JSON schema in '{param}' is invalid: {exc}", param=param) from exc


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body that matches one JSON value of `schema` (llguidance's %json)."""
    return "%json " + json.dumps(_with_options(schema), ensure_ascii=False)


def lark_literal(text: str, special: dict[str, int] | None = None) -> str:
    """Lark for exactly `text`: the control token it names (by id, so only that token matches), else the string."""
    if special and text in special:
        return f"<[{special[text]}]>"
    return json.dumps(text, ensure_ascii=False)


def lark_text(text: str, special: dict[str, int]) -> str:
    """Lark for exactly `text`, the control tokens in it (by the vocabulary's `special`) by id and the rest as
    strings: `<｜tool▁sep｜>` is one token in DeepSeek's vocabulary, text in any other."""
    names = sorted((t for t in special if t and t in text), key=len, reverse=True)
    if not names:
        return lark_literal(text)
    parts = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
    return " ".join(lark_literal(p, special) for p in parts if p)


def lark_grammar(lark: str, *, param: str) -> Grammar:
    return Grammar(llguidance.LLMatcher.grammar_from_lark(lark), param)


def user_grammar(
    *,
    grammar: Any = None,
    json_schema: Any = None,
    structured: Any = None,
) -> Grammar | None:
    """A grammar a request gives itself, as peers take them: llama-server's `grammar` (GBNF, or Lark) and
    `json_schema`, and vLLM's `structured_outputs` (one of `regex`, `choice`, `grammar`, `json`). None when the
    request gives none.

    Raises:
        InvalidRequestError: naming the field: more than one given, a value of the wrong type, or a grammar,
            regex or schema llguidance cannot compile (with its reason).
    """
    given = [
        (name, value)
        for name, value in (
            ("grammar", grammar),
            ("json_schema", json_schema),
            ("structured_outputs", structured),
        )
        if value is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(f"'{n}'" for n, _ in given)
        raise InvalidRequestError(f"{names} each constrain the output: give one of them", param=given[0][0])
    name, value = given[0]
    if name == "grammar":
        return check(_grammar_text(value, "grammar"))
    if name == "json_schema":
        return check(json_schema_grammar(value, param="json_schema"))
    if not isinstance(value, dict):
        raise InvalidRequestError("'structured_outputs' must be an object", param="structured_outputs")
    kinds = [k for k in ("regex", "choice", "grammar", "json") if value.get(k) is not None]
    if len(kinds) != 1:
        raise InvalidRequestError(
            "'structured_outputs' takes exactly one of regex, choice, grammar or json",
            param="structured_outputs",
        )
    kind = kinds[0]
    where = f"structured_outputs.{kind}"
    spec = value[kind]
    if kind == "json":
        return check(json_schema_grammar(spec, param=where))
    if kind == "grammar":
        return check(_grammar_text(spec, where))
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError(f"'{where}' must be a non-empty regular expression", param=where)
        return check(Grammar(llguidance.LLMatcher.grammar_from_regex(spec), where))
    if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
        raise InvalidRequestError(f"'{where}' must be a list of non-empty strings", param=where)
    return check(lark_grammar("start: " + " | ".join(lark_literal(c) for c in spec), param=where))


def _grammar_text(text: Any, param: str) -> Grammar:
    """GBNF (llama.cpp's grammars: `root ::= …`) or Lark, as llguidance reads them."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError(f"'{param}' must be a grammar (GBNF or Lark) as a string", param=param)
    try:
        return lark_grammar(any_to_lark(text), param=param)
    except (GbnfToLarkError, ValueError) as exc:
        raise InvalidRequestError(
            f"'{param}' is not a grammar llguidance can read: {exc}", param=param
        ) from None
