"""OpenAI request schemas (pydantic, the HTTP boundary) and their conversion to SamplingParams."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantserve.errors import InvalidRequestError
from quantserve.server.content import ContentReader
from quantserve.structured import Grammar, user_grammar


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    # Unknown fields are ignored, like OpenAI and vLLM do, so newer clients keep working.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's name for the same thing
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # grammars of the request's own (structured.user_grammar): llama-server's GBNF `grammar` and `json_schema`,
    # vLLM's `structured_outputs` {regex | choice | grammar | json}
    grammar: Any = None
    json_schema: Any = None
    structured_outputs: Any = None

    def user_grammar(self) -> Grammar | None:
        return user_grammar(
            grammar=self.grammar, json_schema=self.json_schema, structured=self.structured_outputs
        )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, … reach the template untouched

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self, i: int, reader: ContentReader) -> dict[str, Any]:
        """The message as chat templates take it (string content, or text and image parts for a user message with
        images; calls with JSON-text arguments).

        Raises:
            InvalidRequestError: naming the field: an image or unknown content part, a tool message without
                tool_call_id, a malformed tool call.
        """
        d = self.model_dump(exclude_none=True)
        where = f"messages[{i}].content"
        d["content"] = (
            reader.content(self.content, where) if self.role == "user" else reader.text(self.content, where)
        )
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError(
                f"'messages[{i}].tool_call_id' is required: a tool message answers the tool call with that id",
                param=f"messages[{i}].tool_call_id",
            )
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError(
                    f"'messages[{i}].tool_calls' belongs to assistant messages",
                    param=f"messages[{i}].tool_calls",
                )
            d["tool_calls"] = [
                _tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(self.tool_calls)
            ]
        return d


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(f"'{where}.function.name' is required", param=f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise InvalidRequestError(
            f"'{where}.function.arguments' must be a JSON string", param=f"{where}.function.arguments"
        )
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"'{where}.id' is required", param=f"{where}.id")
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}}


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False  # vLLM's: the reply continues the final (assistant) message
    reasoning_effort: Any = None  # low, medium or high (templates that read it: gpt-oss, DeepSeek V4)
    reasoning_budget: Any = None  # most reasoning tokens (checked by the LLM, so the 400 names the field)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema response_format asks the reply to match (json_object: any object), or None."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise InvalidRequestError(
            "response_format type 'json_schema' needs a 'json_schema' object with a 'schema'",
            param="response_format",
        )
    return fmt.json_schema.schema_
