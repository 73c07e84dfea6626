"""Tool-call formats: how a family of chat templates asks for tools, writes calls, and how its replies parse.

One module per family in this package, each defining a ToolFormat subclass listed in registered() below (imported
when formats are first needed), so a new family is its file plus one line there. Which format a model uses
is read from its template, never from its name: a probe render writes a known call through the template
(TemplateProbe.turn) and the first format, in priority order, whose parser reads that same call back wins. A
template whose calls no format reads (including templates that know no tools at all) gets the generic format.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

from quantserve.chat.reply import ReplyParser
from quantserve.chat.template import PROBE_CALL, TemplateProbe
from quantserve.chat.tools import Tool, ToolChoice, new_call_id
from quantserve.structured import Grammar, embeddable, json_rule, lark_grammar, lark_literal

log = logging.getLogger("quantserve.chat")


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply may be: calls of `tools` (the named one only, for a named choice), several in one reply if
    `parallel`, as `choice` asks; `schema` is response_format's JSON schema for a reply without calls; `special`
    maps the vocabulary's control-token texts to ids, for markers that are single tokens."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool
    schema: dict[str, Any] | None
    special: dict[str, int]

    def literal(self, text: str) -> str:
        """Lark for a marker: its control token if the vocabulary has one, else the text."""
        return lark_literal(text, self.special)


@cache
def registered() -> list[type[ToolFormat]]:
    """Every family's format in detection order (lowest priority first; the generic one last), each module
    imported on the first call. A new family is its file plus one line here."""
    from quantserve.chat.formats.gemma4 import Gemma4
    from quantserve.chat.formats.generic import Generic
    from quantserve.chat.formats.harmony import Harmony
    from quantserve.chat.formats.hermes import Hermes
    from quantserve.chat.formats.jsonlist import (
        Apertus,
        Apriel,
        CommandR,
        CommandRPlus,
        FireFunction,
        GigaChat,
        GigaChat3,
        Granite,
        MiniMaxM1,
        NemotronV2,
    )
    from quantserve.chat.formats.lfm2 import Lfm2
    from quantserve.chat.formats.llama3 import Llama3
    from quantserve.chat.formats.marked import DeepSeekR1, DeepSeekV31, FunctionaryV31, KimiK2, Solar
    from quantserve.chat.formats.minimax3 import MiniMaxM3
    from quantserve.chat.formats.mistral import Mistral
    from quantserve.chat.formats.muse import MuseGlimmer
    from quantserve.chat.formats.recipient import FunctionaryV32
    from quantserve.chat.formats.xmlcalls import (
        DsmlV4,
        DsmlV32,
        Glm,
        Hunyuan,
        KimiK3,
        MiniCpm,
        MiniMaxM2,
        Qwen3Coder,
        SeedOss,
    )

    found = (
        *(Generic, Hermes, Llama3, Mistral),
        *(
            DeepSeekV31,
            DeepSeekR1,
            KimiK2,
            FunctionaryV31,
            Solar,
            Harmony,
            Gemma4,
            Lfm2,
            FunctionaryV32,
            MuseGlimmer,
        ),
        *(Qwen3Coder, SeedOss, MiniMaxM2, Glm, DsmlV32, DsmlV4, Hunyuan, MiniCpm, KimiK3, MiniMaxM3),
        *(NemotronV2, Apriel, MiniMaxM1, CommandR, GigaChat, GigaChat3, Apertus),
        *(CommandRPlus, FireFunction, Granite),
    )
    return sorted(found, key=lambda cls: cls.priority)


def detect(probe: TemplateProbe, source: str = "", origin: str = "the template") -> ToolFormat:
    """The format of the first registered family that reads the template's probe call back; failing that, of a
    family whose own words the template's `source` holds (LFM2's templates list tools without ever writing a
    call). A template that speaks of tools and is still not read gets the generic format, with a log line."""
    for cls in registered():
        fmt = cls.from_probe(probe)
        if fmt is not None and fmt.name != "generic":
            return fmt
    for cls in registered():
        if cls.hints and all(h in source for h in cls.hints):
            return cls(probe)
    if probe.turn is not None or "tools" in source or "tool_call" in source:  # not a mere `tool` role
        log.warning(
            "%s writes tool calls in a way quantserve does not read; requests with tools get the generic JSON "
            "format (the tools described in the system turn)",
            origin,
        )
    return registered()[-1](probe)


class ToolFormat(ABC):
    """A family's conventions. Instances are immutable and shared by every request to a model."""

    name: ClassVar[str]
    priority: ClassVar[int]  # detection order, lowest first
    native: ClassVar[bool] = True  # the template itself describes the tools and renders calls and results
    hints: ClassVar[tuple[str, ...]] = ()  # texts only this family's templates hold (see detect)
    # every reply is framed by the format, calls or not (a recipient, a response section): its parser reads the
    # replies to requests without tools too, to take the frame off the answer
    frames: ClassVar[bool] = False

    def __init__(self, probe: TemplateProbe):
        self.probe = probe

    @classmethod
    def from_probe(cls, probe: TemplateProbe) -> ToolFormat | None:
        """This format, if its parser reads the probe's call back out of the template's assistant turn."""
        if probe.turn is None:
            return None
        fmt = cls(probe)
        parser = fmt.parser(frozenset({PROBE_CALL["name"]}))
        parser.feed(probe.turn)
        parser.finish()
        calls = [c for c in parser.calls if c.complete]
        ok = (
            not parser.malformed
            and not parser.cut
            and len(calls) == 1
            and calls[0].name == PROBE_CALL["name"]
            and _loads(calls[0].arguments) == PROBE_CALL["arguments"]
        )
        return fmt if ok else None

    # ---- the prompt --------------------------------------------------------------------------------

    def prepare(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Messages as this family's template wants them, and the extra template variables (`tools`).

        The default suits templates that render calls themselves: the arguments of earlier calls become objects
        again, since templates write them with `tojson` (transformers' convention, and vLLM's and llama.cpp's).
        """
        out = [_as_the_template_takes(m, self.probe) for m in messages]
        extra = {"tools": [t.as_openai() for t in tools]} if tools and choice.mode != "none" else {}
        return out, extra

    # ---- constrained decoding and parsing ---------------------------------------------------------

    @abstractmethod
    def grammar(self, spec: GrammarSpec) -> Grammar:
        """What the reply may be (see GrammarSpec)."""

    @abstractmethod
    def parser(self, tools: frozenset[str]) -> ReplyParser:
        """A fresh parser for one reply; a call is only a call if it names one of `tools`."""

    @property
    def markers(self) -> tuple[str, ...]:
        """What a reply's calls begin with (a model that skips its end-of-thinking marker and calls a tool has
        ended its reasoning there, as llama.cpp reads it); none for a format without markers."""
        return ()

    def reply_parser(self, tools: tuple[Tool, ...]) -> ReplyParser:
        """The parser for a reply that may call `tools` (formats that read values by their schemas override)."""
        return self.parser(frozenset(t.name for t in tools))

    def new_id(self) -> str:
        return new_call_id()


def _loads(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _as_the_template_takes(message: dict[str, Any], probe: TemplateProbe) -> dict[str, Any]:
    """An assistant message's calls as the probe found the template takes them: arguments as objects (most), or
    as JSON text, and an empty content as none where the template writes calls only then (R1's distills)."""
    if not message.get("tool_calls"):
        return message
    out = message if probe.text_arguments else _with_object_arguments(message)
    return {**out, "content": message.get("content") or (None if probe.none_content else "")}


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            parsed = _loads(fn["arguments"])
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out, "content": message.get("content") or ""}


def call_schema(tool: Tool, args_key: str = "arguments", **extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON of one call: {"name": <this tool>, args_key: <its parameters>} and any `extra` properties
    (optional), in that order."""
    params = embeddable(tool.parameters, f"{tool.name}.")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: params, **extra},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def keyword_sequence(pairs: dict[str, str], required: set[str], sep: str) -> str:
    """Lark for an object's or a call's key-value `pairs` (key -> its Lark) written in order, separated by `sep`
    (Lark): the required ones, then any of the optional ones; with none required, nothing or a first one and any
    later ones. For formats whose arguments are not JSON (Gemma 4, LFM2)."""
    must = [k for k in pairs if k in required]
    may = [k for k in pairs if k not in required]

    def later(keys: list[str]) -> str:
        return "".join(f" ({sep} {pairs[k]})?" for k in keys)

    if must:
        return f" {sep} ".join(pairs[k] for k in must) + later(may)
    if may:
        return "(" + " | ".join(f"({pairs[k]}{later(may[i + 1 :])})" for i, k in enumerate(may)) + ")?"
    return ""


TEXT_RULE = "TEXT: /(.|\\n)*/"  # any text at all (control tokens never match text)


def trigger_rule(marker: str, spec: GrammarSpec) -> str:
    """A Lark rule `trig` for free text that ends with `marker`: a control token ends the text by itself; a marker
    written as text needs a lazy match (the text ends at the marker's first appearance)."""
    if marker in spec.special:
        return f"trig: TEXT {spec.literal(marker)}"
    return f"trig[lazy]: TEXT {lark_literal(marker)}"


def calls_grammar(spec: GrammarSpec, rules: str, free: str) -> Grammar:
    """A family's grammar from its Lark `rules`, which define `calls` (a reply's calls): `required` is calls,
    a response schema makes it calls or that JSON, and `auto` starts with `free` (its text, in which a call, once
    opened, is held to the schemas; free may begin with a %llguidance line)."""
    if spec.choice.mode == "required":
        start = "start: calls"
    elif spec.schema is not None:
        start = f"start: calls | {json_rule(spec.schema)}"
    else:
        start = free
    return lark_grammar(f"{start}\n{rules}", param="tools")
