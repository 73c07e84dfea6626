"""LFM2: calls as a Python list of calls with keyword arguments between markers,

    <|tool_call_start|>[get_time(city="Paris"), special_function(arg1=1)]<|tool_call_end|>

read with Python's own parser (`ast`, never evaluated): constants, lists, dicts and tuples only, where JSON's
true/false/null stand for True/False/None as LFM2 writes both. A call's arguments are sent once its list closes.
"""

from __future__ import annotations

import ast
from typing import Any

from quantserve.chat.formats import (
    TEXT_RULE,
    GrammarSpec,
    ToolFormat,
    calls_grammar,
    keyword_sequence,
    trigger_rule,
)
from quantserve.chat.reply import Event, ReplyParser
from quantserve.chat.tools import Tool
from quantserve.structured import Grammar, json_rule, lark_literal, lark_text

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def literal(node: ast.AST) -> Any:
    """The value of a literal: the only nodes read (anything else is not this format).

    Raises:
        ValueError: a node that is not a literal.
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [literal(x) for x in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {str(literal(k)): literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    raise ValueError(f"not a literal: {type(node).__name__}")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def read_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """`[name(k=v, …), …]` as (name, arguments) pairs.

    Raises:
        ValueError: anything else (a syntax error included).
    """
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    out = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ValueError("not a call with keyword arguments")
        out.append((_dotted(node.func), {k.arg: literal(k.value) for k in node.keywords}))  # type: ignore[misc]
    return out


class Lfm2(ToolFormat):
    name = "lfm2"
    priority = 47
    markers = (OPEN,)
    hints = ("List of tools: ", "<|im_start|>")  # LFM2's system turn; its templates never write a call

    def grammar(self, spec: GrammarSpec) -> Grammar:
        calls = " | ".join(_call_rule(t) for t in spec.tools)
        more = '(", " call)*' if spec.parallel else ""
        rest = f'"[" call {more} "]" {lark_text(CLOSE, spec.special)}'
        rules = f"call: {calls}\nrest: {rest}\ncalls: {lark_text(OPEN, spec.special)} rest"
        free = f"%llguidance {{}}\nstart: TEXT | trig rest\n{trigger_rule(OPEN, spec)}\n{TEXT_RULE}"
        return calls_grammar(spec, rules, free)

    def parser(self, tools: frozenset[str]) -> Lfm2Parser:
        return Lfm2Parser(self.new_id, tools)


def _call_rule(tool: Tool) -> str:
    """name(k=v, …): the required keywords in order, then any of the optional ones; values in JSON (which
    LFM2's parser reads as well as Python's literals)."""
    params = tool.parameters
    props: dict[str, Any] = params.get("properties") or {}
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    required = set(params.get("required") or ())
    pair = {k: f"{lark_literal(k + '=')} {json_rule({**props[k], **defs})}" for k in props}
    body = keyword_sequence(pair, required, '", "')
    return f'{lark_literal(tool.name)} "(" {body} ")"'


class Lfm2Parser(ReplyParser):
    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "text"

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.state == "text":
                events, found = self._text_until(OPEN, final)
                out += events
                if not found:
                    return out
                self.state = "calls"
            if self.state == "calls":
                end = self.text.find(CLOSE, self.cur)
                if end == -1 and not final:
                    return out
                body = self.text[self.cur : end if end != -1 else len(self.text)]
                try:
                    calls = read_calls(body)
                except ValueError:
                    if end != -1:
                        self.malformed = True
                        return out
                    calls = _complete_ones(body)  # cut off: the calls written in full
                    self.cut = True
                for name, args in calls:
                    out += self._whole_call(name, args)
                    if self.malformed:
                        return out
                if end == -1:
                    return out
                self.cur = end + len(CLOSE)
                self.state = "text"


def _complete_ones(body: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls of a list cut off after them: the longest prefix that closes into a list that reads."""
    for at in range(len(body), 0, -1):
        if body[at - 1] == ")":
            try:
                return read_calls(body[:at] + "]")
            except ValueError:
                continue
    return []
