"""Anthropic's Messages API request (pydantic, the HTTP boundary) and its translation to chat messages and tools.

`system` becomes a system message; a user message's `tool_result` blocks become `tool` messages (before its
text); an assistant message's `tool_use` blocks become its tool_calls, their `input` JSON text as arguments.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantserve.chat import Tool, ToolChoice
from quantserve.chat.tools import check_unique, checked_choice, make_tool
from quantserve.errors import InvalidRequestError
from quantserve.server.content import ContentReader, join

TEXT = frozenset({"text"})


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its "format": {"type": "json_schema", "schema": {...}}
    thinking: Any = None  # {"type": "enabled", "budget_tokens": N} or {"type": "disabled"} (see thinking())
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def response_schema(self) -> dict[str, Any] | None:
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            raise InvalidRequestError(
                '\'output_config.format\' must be {"type": "json_schema", "schema": {...}}',
                param="output_config.format",
            )
        return fmt["schema"]

    def thinking_controls(self) -> tuple[bool | None, int | None]:
        """`thinking` as (on, off or unsaid; its budget).

        Raises:
            InvalidRequestError: a `thinking` that is not one of Anthropic's two shapes, or a budget that is not
                a positive integer below max_tokens.
        """
        t = self.thinking
        if t is None:
            return None, None
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "disabled":
            return False, None
        if kind not in ("enabled", "adaptive"):
            raise InvalidRequestError(
                '\'thinking\' must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}',
                param="thinking",
            )
        budget = t.get("budget_tokens")
        if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise InvalidRequestError(
                f"'thinking.budget_tokens' must be a positive integer; got {budget!r}",
                param="thinking.budget_tokens",
            )
        if budget is not None and budget >= self.max_tokens:
            raise InvalidRequestError(
                f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({self.max_tokens}): the "
                "answer comes after the thinking, within max_tokens",
                param="thinking.budget_tokens",
            )
        return True, budget

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (len(v) > 16 or any(not s for s in v)):
            raise ValueError("at most 16 stop sequences, none of them empty")
        return v


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None


def anthropic_tools(raw: list[Any] | None) -> tuple[Tool, ...]:
    """Client tools: [{"name", "description", "input_schema"}]."""
    tools = []
    for i, item in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type", "custom") != "custom":
            kind = item.get("type") if isinstance(item, dict) else None
            raise InvalidRequestError(
                f"'{where}' has type {kind!r}; this server runs client tools only "
                '({"name": ..., "input_schema": {...}})',
                param=where,
            )
        if "input_schema" not in item:
            raise InvalidRequestError(f"'{where}.input_schema' is required", param=f"{where}.input_schema")
        tools.append(
            make_tool(
                item.get("name"),
                item.get("description"),
                item["input_schema"],
                param=where,
                schema_param=f"{where}.input_schema",
            )
        )
    return check_unique(tools, "tools")


def anthropic_tool_choice(raw: dict[str, Any] | None, tools: tuple[Tool, ...]) -> tuple[ToolChoice, bool]:
    """(choice, parallel): auto, any (some call), tool (that one), none; disable_parallel_tool_use."""
    if raw is None:
        return ToolChoice("auto" if tools else "none"), True
    kind = raw.get("type")
    parallel = not raw.get("disable_parallel_tool_use", False)
    if kind == "auto":
        choice = ToolChoice("auto" if tools else "none")
    elif kind == "any":
        choice = ToolChoice("required")
    elif kind == "none":
        choice = ToolChoice("none")
    elif kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise InvalidRequestError(
                "'tool_choice.name' is required with type 'tool'", param="tool_choice.name"
            )
        choice = ToolChoice("required", raw["name"])
    else:
        raise InvalidRequestError(
            f"'tool_choice.type' must be auto, any, tool or none; got {kind!r}", param="tool_choice.type"
        )
    return checked_choice(choice, tools, "tool_choice"), parallel


def system_text(system: str | list[dict[str, Any]] | None, reader: ContentReader) -> str:
    return reader.text(system, "system", TEXT)


def chat_messages(messages: list[AnthropicMessage], reader: ContentReader) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        parts: list[str | dict[str, Any]] = []  # texts and images, in order
        calls: list[dict[str, Any]] = []
        thoughts: list[str] = []
        for j, block in enumerate(m.content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}[{j}]"
            if kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise InvalidRequestError(f"'{at}.tool_use_id' is required", param=f"{at}.tool_use_id")
                content = reader.text(block.get("content"), f"{at}.content", TEXT)
                if block.get("is_error"):
                    content = f"Error: {content}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
            elif kind == "tool_use" and m.role == "assistant":
                for key in ("id", "name"):
                    if not isinstance(block.get(key), str) or not block[key]:
                        raise InvalidRequestError(f"'{at}.{key}' is required", param=f"{at}.{key}")
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                function = {"name": block["name"], "arguments": arguments}
                calls.append({"id": block["id"], "type": "function", "function": function})
            elif kind == "thinking" and m.role == "assistant":
                # earlier reasoning goes back to the template, which keeps what its family keeps; the signature
                # is ours (see routes.SIGNATURE) and carries nothing to check
                if not isinstance(block.get("thinking"), str):
                    raise InvalidRequestError(f"'{at}.thinking' must be a string", param=f"{at}.thinking")
                thoughts.append(block["thinking"])
            elif kind != "redacted_thinking":  # another server's encrypted reasoning: nothing to read
                parts.append(reader.part(block, at, TEXT, images=m.role == "user"))
        if parts or calls or not m.content:
            message: dict[str, Any] = {"role": m.role, "content": join(parts)}
            if thoughts:
                message["reasoning_content"] = "\n\n".join(thoughts)
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out
