"""The generic format, for every template whose tool calls no other format reads (SmolLM2's, or any template that
knows no tools): the tools are described in the system turn, and the whole reply is one JSON object,
`{"tool_call": {"name": …, "arguments": {…}}}`, `{"tool_calls": [...]}` when parallel calls are allowed, or
`{"response": "…"}` for a reply in words. The grammar always holds the model to that object, so even a tiny model
answers in a form that parses (llama.cpp's generic handler works the same way)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from quantserve.chat.formats import GrammarSpec, ToolFormat, call_schema, one_of
from quantserve.chat.reply import Event, JsonCallParser, TextDelta
from quantserve.chat.template import TemplateProbe
from quantserve.chat.tools import Tool, ToolChoice
from quantserve.structured import Grammar, embeddable, json_schema_grammar


def _calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    call = one_of([call_schema(t) for t in tools])
    if parallel:
        prop = {"tool_calls": {"type": "array", "items": call, "minItems": 1}}
    else:
        prop = {"tool_call": call}
    return {"type": "object", "properties": prop, "required": list(prop), "additionalProperties": False}


def _instructions(tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool) -> str:
    listing = json.dumps([t.as_openai()["function"] for t in tools], indent=2, ensure_ascii=False)
    call = '{"name": <tool name>, "arguments": {<its arguments>}}'
    calls = f'{{"tool_calls": [{call}, ...]}}' if parallel else f'{{"tool_call": {call}}}'
    if choice.mode == "required":
        what = f"call the tool {choice.name}" if choice.name else "call one of the tools"
        how = f"Reply with one JSON object and nothing else: {calls}."
    else:
        what = "call them when they help answer the user"
        how = f'Reply with one JSON object and nothing else: {calls} to call tools, or {{"response": "<your reply>"}}.'
    return f"You can use these tools; {what}.\n{listing}\n\n{how}"


class Generic(ToolFormat):
    name = "generic"
    priority = 1000  # the fallback: tried last, and it takes any template
    native = False

    @classmethod
    def from_probe(cls, probe: TemplateProbe) -> Generic:
        return cls(probe)

    def prepare(self, messages, tools, choice, parallel):
        """The tools as instructions in the system turn, earlier calls and replies as the JSON this format
        writes, tool results as `tool` messages (or as user messages, for templates without that role)."""
        active = bool(tools) and choice.mode != "none"
        names = {
            c.get("id"): (c.get("function") or {}).get("name")
            for m in messages
            for c in m.get("tool_calls") or []
        }
        out: list[dict[str, Any]] = []
        for m in messages:
            role = m.get("role")
            if role == "assistant" and m.get("tool_calls"):
                calls = [_call_json(c) for c in m["tool_calls"]]
                obj = (
                    {"tool_calls": calls}
                    if len(calls) > 1 or (active and parallel)
                    else {"tool_call": calls[0]}
                )
                m = {"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)}
            elif role == "assistant" and active:
                m = {**m, "content": json.dumps({"response": m.get("content") or ""}, ensure_ascii=False)}
            elif role == "tool":
                if not self.probe.tool_role:
                    body = {
                        "tool_response": {
                            "name": names.get(m.get("tool_call_id")),
                            "content": m.get("content"),
                        }
                    }
                    m = {"role": "user", "content": json.dumps(body, ensure_ascii=False)}
                else:
                    m = {"role": "tool", "content": m.get("content") or ""}
            out.append(m)
        if active:
            text = _instructions(tools, choice, parallel)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
            else:
                out.insert(0, {"role": "system", "content": text})
        if out and out[0].get("role") == "system" and not self.probe.system_role and len(out) > 1:
            first, second = out[0], out[1]
            out[1:2] = [{**second, "content": f"{first.get('content')}\n\n{second.get('content') or ''}"}]
            del out[0]
        return out, {}

    def grammar(self, spec: GrammarSpec) -> Grammar:
        calls = _calls_schema(spec.tools, spec.parallel)
        if spec.choice.mode == "required":
            return json_schema_grammar(calls, param="tools")
        text = embeddable(spec.schema, "response.") if spec.schema else {"type": "string"}
        response = {
            "type": "object",
            "properties": {"response": text},
            "required": ["response"],
            "additionalProperties": False,
        }
        return json_schema_grammar({"anyOf": [calls, response]}, param="tools")

    def parser(self, tools: frozenset[str]) -> GenericParser:
        return GenericParser(self.new_id, tools)


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    return {"name": fn.get("name"), "arguments": args}


class GenericParser(JsonCallParser):
    """Streams the "response" string as text as it decodes, and each call as it is written."""

    def __init__(self, new_id, tools):
        super().__init__(new_id, tools)
        self.state = "start"
        self._said = ""  # the decoded response sent so far

    def _parse(self, final: bool) -> list[Event]:
        out: list[Event] = []
        if self.state == "start":
            rest = self.text.lstrip()
            if not rest:
                self.malformed = final
                return out
            if rest[0] != "{":
                self.malformed = True  # not this format: the reply is returned as the text it is
                self.state = "junk"
                return out
            self._scan(len(self.text) - len(rest))
            self.state = "object"
        if self.state != "object":
            return out
        sc = self._advance(final)
        response = sc.spans.get(("response",))
        if response is not None and response.kind == "string":
            said = sc.partial_string(("response",))
            if said is not None and len(said) > len(self._said):
                out.append(TextDelta(said[len(self._said) :]))
                self._said = said
        elif response is not None and response.end is not None and not self._said:
            # a JSON response (response_format's schema): sent whole once complete
            self._said = sc.text[response.start : response.end]
            out.append(TextDelta(self._said))
        if ("tool_call",) in sc.spans and not self.calls:
            self._call(sc, ("tool_call",))
        while ("tool_calls", len(self.calls)) in sc.spans:
            self._call(sc, ("tool_calls", len(self.calls)))
        for call in self.calls:
            out += call.poll()
        if (
            sc.error
            or any(c.rejected for c in self.calls)
            or (sc.done and response is None and not self.calls)
        ):
            self.malformed = True
        elif final and not sc.done and self.calls:
            self.cut = True  # cut off inside the calls (max_tokens)
        elif final and not sc.done and response is None:
            self.malformed = (
                True  # cut off before anything usable; a cut-off response is still the words said
            )
        if sc.done or sc.error:
            self.state = "done"
        return out
