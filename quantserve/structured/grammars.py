"""Grammars for constrained decoding, in llguidance's serialized form: JSON schemas, and Lark for tool calls.

JSON is generated in the spacing Python's json.dumps and the chat templates' `tojson` use (", " and ": ", no other
whitespace): it is what models were trained to read and write, and a weak model that may not add whitespace cannot
ramble on in it until max_tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from quantserve.errors import InvalidRequestError

# llguidance's JSON compiler options (its "x-guidance" schema key)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's serialized form, and the request field it came from (named in errors)."""

    source: str
    param: str


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


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


def lark_grammar(lark: str, *, param: str) -> Grammar:
    return Grammar(llguidance.LLMatcher.grammar_from_lark(lark), param)
