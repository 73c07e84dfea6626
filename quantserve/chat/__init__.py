"""Chats above the engine: chat templates, function tools, each model family's tool-call format, and the parsing
of replies into text and tool calls."""

from __future__ import annotations

from quantserve.chat.prompt import ChatPrompt, ChatRequest, build_prompt, tool_format
from quantserve.chat.reply import CallDelta, Event, ReasoningDelta, Reply, ReplyAssembler, TextDelta
from quantserve.chat.template import ChatTemplate
from quantserve.chat.tools import Tool, ToolCall, ToolChoice

__all__ = [
    "CallDelta",
    "ChatPrompt",
    "ChatRequest",
    "ChatTemplate",
    "Event",
    "ReasoningDelta",
    "Reply",
    "ReplyAssembler",
    "TextDelta",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "build_prompt",
    "tool_format",
]
