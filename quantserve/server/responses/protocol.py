"""The Responses API's request (pydantic, the HTTP boundary) and its translation to and from chat messages.

Input items become the chat messages the model's template renders: `message` items by role, `function_call`
items as an assistant message's tool_calls, `function_call_output` items as `tool` messages. A reply becomes output
items: a `message` with its text, then one `function_call` item per call.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from quantserve.chat import Reply, Tool, ToolChoice
from quantserve.chat.tools import check_unique, make_tool, parse_openai_tool_choice
from quantserve.errors import InvalidRequestError
from quantserve.server.content import ContentReader

INPUT_TEXT = frozenset({"input_text", "output_text", "text"})


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer client fields are ignored, as elsewhere

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": low|medium|high, "summary": ...}; the effort is used
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    def response_schema(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "object"}
        if fmt.schema_ is None:
            raise InvalidRequestError(
                "text.format of type 'json_schema' needs a 'schema'", param="text.format.schema"
            )
        return fmt.schema_


def response_tools(raw: list[Any] | None) -> tuple[Tool, ...]:
    """Function tools: [{"type": "function", "name", "description", "parameters", "strict"}]."""
    tools = []
    for i, item in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            kind = item.get("type") if isinstance(item, dict) else None
            raise InvalidRequestError(
                f'\'{where}\' has type {kind!r}; this server runs function tools only ({{"type": "function", '
                '"name": ..., "parameters": {...}})',
                param=where,
            )
        tools.append(
            make_tool(item.get("name"), item.get("description"), item.get("parameters"), param=where)
        )
    return check_unique(tools, "tools")


def tool_choice(raw: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    return parse_openai_tool_choice(raw, tools)  # its dict form {"type": "function", "name": ...} is read too


def input_messages(raw: str | list[Any], reader: ContentReader) -> list[dict[str, Any]]:
    """The input items as chat messages.

    Raises:
        InvalidRequestError: naming the item: an unknown item type, a missing field, a bad content part.
    """
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(
                    f"'{where}.role' must be user, assistant, system or developer; got {role!r}",
                    param=f"{where}.role",
                )
            read = reader.content if role == "user" else reader.text
            content = read(item.get("content"), f"{where}.content", INPUT_TEXT)
            last = out[-1] if out else {}
            if role == "assistant" and last.get("role") == "assistant" and not last.get("content"):
                out[-1] = {**last, "content": content}  # the answer after its reasoning item
            else:
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": item.get("arguments") or "{}"},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = (
                output if isinstance(output, str) else reader.text(output, f"{where}.output", INPUT_TEXT)
            )
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": content})
        elif kind == "reasoning":  # earlier reasoning, for the next assistant message (the template decides)
            texts = [p.get("text") for p in item.get("content") or [] if isinstance(p, dict)]
            thought = "".join(t for t in texts if isinstance(t, str))
            if thought:
                out.append({"role": "assistant", "content": "", "reasoning_content": thought})
        else:
            raise InvalidRequestError(
                f"'{where}' has type {kind!r}; input items may be message, function_call or function_call_output",
                param=f"{where}.type",
            )
    if not out:
        raise InvalidRequestError("'input' has no messages", param="input")
    return out


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{where}.{name}' is required", param=f"{where}.{name}")
    return value


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else [],
    }


def call_item(
    call_id: str, name: str, arguments: str, item_id: str | None = None, status="completed"
) -> dict:
    return {
        "id": item_id or f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id or f"rs_{uuid.uuid4().hex}",
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def output_items(reply: Reply) -> list[dict[str, Any]]:
    items = [reasoning_item(reply.reasoning)] if reply.reasoning else []
    items += [message_item(reply.content)] if reply.content else []
    return items + [call_item(c.id, c.name, c.arguments) for c in reply.tool_calls]


def messages_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a later turn renders (previous_response_id)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {"name": it["name"], "arguments": it["arguments"]},
        }
        for it in items
        if it["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thought = "".join(p["text"] for it in items if it["type"] == "reasoning" for p in it["content"])
    if thought:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = calls
    return [message]


def echo_tools(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": False,
        }
        for t in tools
    ]


def echo_choice(choice: ToolChoice) -> str | dict[str, Any]:
    return {"type": "function", "name": choice.name} if choice.name else choice.mode
