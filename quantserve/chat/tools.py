"""Function tools, the caller's choice among them, and the tool calls a reply makes, checked at the boundary.

All three APIs (chat completions, Responses, Anthropic Messages) come down to these types; each translates its own
wire shape into them, naming its own fields in errors.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from quantserve.errors import InvalidRequestError

# OpenAI's rule (a-z, A-Z, 0-9, _ and -, up to 64), widened to Anthropic's 128 characters and MCP's dots
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_ALNUM = string.ascii_letters + string.digits
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def as_openai(self) -> dict[str, Any]:
        """The shape chat templates expect in `tools` (transformers' convention)."""
        # a description always, empty if none was given, as llama.cpp writes tools: templates read it unguarded
        fn: dict[str, Any] = {"name": self.name, "description": self.description or ""}
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """none: never call; auto: the model decides; required: at least one call (only `name`, when given)."""

    mode: Literal["none", "auto", "required"] = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments' JSON text, as the model wrote it


def new_call_id(length: int = 24, prefix: str = "call_") -> str:
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


def make_tool(name: Any, description: Any, parameters: Any, *, param: str, schema_param: str = "") -> Tool:
    """A Tool from one API's fields. `param` is where the tool sits in the request (e.g. "tools[0].function"),
    `schema_param` where its schema does (default: `param`.parameters).

    Raises:
        InvalidRequestError: a missing or malformed name, a description that is not a string, or parameters that
            are not a valid JSON schema of an object.
    """
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"'{param}.name' is required: every tool needs a name", param=f"{param}.name"
        )
    if not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"'{param}.name' {name!r} is not a valid tool name: use 1 to 128 letters, digits, '_', '-' or '.'",
            param=f"{param}.name",
        )
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"'{param}.description' must be a string", param=f"{param}.description")
    where = schema_param or f"{param}.parameters"
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"'{where}' must be a JSON schema object", param=where)
    try:
        validator_for(parameters, default=Draft202012Validator).check_schema(parameters)
    except SchemaError as exc:
        raise InvalidRequestError(
            f"'{where}' is not a valid JSON schema: {exc.message}", param=where
        ) from None
    except RecursionError:
        raise InvalidRequestError(f"'{where}' is nested too deeply", param=where) from None
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError(
            f'\'{where}\' must describe an object ("type": "object"): tool arguments are named', param=where
        )
    # `{}`, or a schema that leaves the type out, still means an object of arguments, and the grammar says so
    return Tool(name, description, {"type": "object", **parameters})


def check_unique(tools: list[Tool], param: str) -> tuple[Tool, ...]:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise InvalidRequestError(
                f"'{param}[{i}]' repeats the tool name {t.name!r}", param=f"{param}[{i}]"
            )
        seen.add(t.name)
    return tuple(tools)


def parse_openai_tools(raw: list[Any] | None, param: str = "tools") -> tuple[Tool, ...]:
    """Chat completions' `tools`: [{"type": "function", "function": {name, description, parameters}}]."""
    tools = []
    for i, item in enumerate(raw or []):
        where = f"{param}[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise InvalidRequestError(
                f'\'{where}\' must be a function tool: {{"type": "function", "function": {{...}}}}',
                param=where,
            )
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"'{where}.function' is required", param=f"{where}.function")
        tools.append(
            make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), param=f"{where}.function")
        )
    return check_unique(tools, param)


def parse_openai_tool_choice(raw: Any, tools: tuple[Tool, ...], param: str = "tool_choice") -> ToolChoice:
    """Chat completions' `tool_choice`: none, auto, required, or {"type": "function", "function": {"name": …}}."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"'{param}' must be 'none', 'auto', 'required' or a function; got {raw!r}", param=param
            )
        return checked_choice(ToolChoice(raw), tools, param)  # type: ignore[arg-type]
    name = None
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else raw.get("name")  # the Responses API puts it at top
    if not isinstance(name, str):
        raise InvalidRequestError(
            f"'{param}' must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
            '{"name": ...}}',
            param=param,
        )
    return checked_choice(ToolChoice("required", name), tools, param)


def checked_choice(choice: ToolChoice, tools: tuple[Tool, ...], param: str) -> ToolChoice:
    if choice.mode == "required" and not tools:
        raise InvalidRequestError(
            f"'{param}' asks for a tool call, but the request has no tools", param=param
        )
    if choice.name is not None and choice.name not in {t.name for t in tools}:
        raise InvalidRequestError(
            f"'{param}' names the function {choice.name!r}, which is not among the tools "
            f"({', '.join(t.name for t in tools)})",
            param=param,
        )
    return choice


class CallChecker:
    """Checks a parsed call against the tools: a known name, and arguments that are a JSON object matching the
    tool's parameter schema."""

    def __init__(self, tools: tuple[Tool, ...]):
        self._validators = {
            t.name: validator_for(t.parameters, default=Draft202012Validator)(t.parameters) for t in tools
        }

    def problem(self, call: ToolCall) -> str | None:
        """What is wrong with the call, or None."""
        validator = self._validators.get(call.name)
        if validator is None:
            return f"unknown tool {call.name!r}"
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError as exc:
            return f"arguments of {call.name!r} are not JSON ({exc.msg})"
        if not isinstance(args, dict):
            return f"arguments of {call.name!r} are not a JSON object"
        error = best_match(validator.iter_errors(args))
        return f"arguments of {call.name!r} do not match its schema: {error.message}" if error else None
