"""A model's reply, as it streams, turned into text and tool calls: the events every API encodes in its own shape.

A ReplyParser (one subclass per tool-call format, in quantserve.chat.formats) reads the generated text and emits
TextDelta and CallDelta events: a call's id and name once the name is complete, then its arguments in fragments
that concatenate to the JSON the model wrote. ReplyAssembler keeps what was said and, at the end, checks every call
against the tools: a reply whose calls do not hold up (unknown tool, arguments that are not JSON or fail the tool's
schema, a call left unfinished when the model stopped) is returned as plain text content, never as a broken call.
A reply cut off by max_tokens inside its calls keeps the calls written in full and drops the unfinished one, and so
does the stream: a call's deltas are held until the call is complete, then sent in order. Cut inside its first call,
a reply keeps its text as written instead, so that no reply comes back empty.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from quantserve.chat.jsonscan import JsonScanner, Path, Span
from quantserve.chat.reasoning import ReasoningSplitter, holdback
from quantserve.chat.tools import CallChecker, ToolCall

log = logging.getLogger("quantserve.chat")


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """Part of tool call `index`: its first delta has `id` and `name`, later ones a fragment of `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ReasoningDelta:
    """Part of the model's reasoning (its thinking), which comes before the answer."""

    text: str


Event = TextDelta | CallDelta | ReasoningDelta


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str  # stop, length or tool_calls
    reasoning: str | None = None


def cut_char(text: str) -> str:
    """`text` without the replacement character a reply cut inside a UTF-8 character ends with (max_tokens in
    the middle of a marker such as DeepSeek's `<｜tool▁call▁begin｜>`)."""
    return text.removesuffix("\ufffd")


class Content:
    """Text outside tool calls, trimmed: leading whitespace is dropped and trailing whitespace held until more
    text follows, so the whitespace around calls never reaches the client."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def add(self, text: str) -> list[Event]:
        if not self._started:
            text = text.lstrip()
            if not text:
                return []
            self._started = True
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept) :]
        return [TextDelta(kept)] if kept else []


class CallStream:
    """One tool call written as a JSON object inside a scanned text: the name once it is complete, then the
    arguments' text as it grows. With `name` given (written outside the JSON), the JSON at `prefix` is the
    arguments themselves. A name that is not one of `tools` makes it `rejected`, and it says nothing: no client
    is told of a call that is not one."""

    def __init__(
        self,
        scanner: JsonScanner,
        prefix: Path,
        index: int,
        call_id: str,
        tools: frozenset[str],
        *,
        name: str | None = None,
        args_keys: tuple[str, ...] = ("arguments", "parameters"),
        whole: bool = False,
        name_key: str = "name",
    ):
        self.scanner, self.prefix, self.index, self.id = scanner, prefix, index, call_id
        self.whole = whole  # complete only once its whole object is (it carries more than its arguments)
        self.name_key = name_key
        self.tools = tools
        self.name = name
        self.args_root = name is not None
        self.args_keys = args_keys
        self.started = False
        self.rejected = False
        self.arguments = ""

    def _args_span(self) -> Span | None:
        if self.args_root:
            return self.scanner.spans.get(self.prefix)
        for key in self.args_keys:
            span = self.scanner.spans.get((*self.prefix, key))
            if span is not None:
                return span
        return None

    @property
    def complete(self) -> bool:
        span = self.scanner.spans.get(self.prefix) if self.whole else self._args_span()
        return self.started and span is not None and span.end is not None

    def poll(self) -> list[Event]:
        events: list[Event] = []
        if self.rejected:
            return events
        if not self.started:
            if self.name is None:
                self.name = self.scanner.string_value((*self.prefix, self.name_key))
                if self.name is None:
                    return events
            if self.name not in self.tools:
                self.rejected = True
                return events
            self.started = True
            events.append(CallDelta(self.index, id=self.id, name=self.name))
        span = self._args_span()
        if span is not None:
            upto = span.end if span.end is not None else self.scanner.pos
            text = self.scanner.text[span.start : upto]
            if len(text) > len(self.arguments):
                events.append(CallDelta(self.index, arguments=text[len(self.arguments) :]))
                self.arguments = text
        return events


class WholeCall:
    """A call read whole, its arguments known at once (the interface of CallStream), for formats whose
    arguments are not JSON as written (Gemma 4) or whose name is a key of the arguments' object (Apertus)."""

    def __init__(self, index: int, call_id: str, name: str, tools: frozenset[str], args: Any):
        self.index, self.id, self.name = index, call_id, name
        self.rejected = name not in tools
        self.started = self.complete = not self.rejected
        self.arguments = json.dumps(args, ensure_ascii=False)
        self._sent = False

    def poll(self) -> list[Event]:
        if self.rejected or self._sent:
            return []
        self._sent = True
        return [
            CallDelta(self.index, id=self.id, name=self.name),
            CallDelta(self.index, arguments=self.arguments),
        ]


class ReplyParser(ABC):
    """Base of the per-format parsers: text in (feed, then finish), events out. After finish, `malformed` says
    the text did not follow the format (it is then returned as plain text), `cut` that it ended inside the format
    (a call or its markup unfinished), and `calls` holds every call begun."""

    def __init__(self, new_id: Callable[[], str], tools: frozenset[str]):
        self.new_id = new_id
        self.tools = tools
        self.text = ""
        self.cur = 0  # the text before this index is read
        self.calls: list[CallStream] = []
        self.malformed = False
        self.cut = False
        self.content = Content()

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return (
            [] if self.malformed else self._parse(final=False)
        )  # a malformed reply is text: nothing more is read

    def _text_until(self, marker: str, final: bool) -> tuple[list[Event], bool]:
        """The text from self.cur up to `marker`, as content; True once the marker is found (self.cur is then just
        past it). Text that may be the marker's start is held back until more comes (or the reply ends)."""
        events, found = self._text_until_any((marker,), final)
        if found is not None:
            self.cur += len(found)
        return events, found is not None

    def _text_until_any(self, markers: tuple[str, ...], final: bool) -> tuple[list[Event], str | None]:
        """The text from self.cur up to the first of `markers`, as content, and that marker (self.cur is then at
        it), or None while none has come (the text that may begin one is held back)."""
        hits = [(k, -len(m), m) for m in markers if (k := self.text.find(m, self.cur)) != -1]
        if hits:
            end, _, found = min(hits)  # the first, and of those that start there the longest
            if not final and any(len(m) > len(found) and m.startswith(self.text[end:]) for m in markers):
                found = None  # a longer marker that begins with this one may still come
        else:
            end, found = len(self.text) - (0 if final else holdback(self.text[self.cur :], markers)), None
        events = self.content.add(self.text[self.cur : end])
        self.cur = end
        return events, found

    def _call(
        self, scanner: JsonScanner, prefix: Path, *, name: str | None = None, call_id: str = "", **keys: Any
    ) -> CallStream:
        """Begin the next call, found at `prefix` of `scanner`'s JSON (`keys`: CallStream's whole, name_key and
        args_keys)."""
        index, new = len(self.calls), call_id or self.new_id()
        call = CallStream(scanner, prefix, index, new, self.tools, name=name, **keys)
        self.calls.append(call)
        return call

    def finish(self) -> list[Event]:
        return [] if self.malformed else self._parse(final=True)

    def _whole_call(self, name: str, args: object) -> list[Event]:
        """Add a call read whole and return its events. A name that is not a tool makes the reply malformed (and
        nothing after it is read: feed)."""
        call = WholeCall(len(self.calls), self.new_id(), name, self.tools, args)
        self.calls.append(call)  # type: ignore[arg-type]
        if call.rejected:
            self.malformed = True
        return call.poll()

    @abstractmethod
    def _parse(self, final: bool) -> list[Event]:
        """Read what is new in self.text (all of it, when final) and return the events it makes."""


class JsonCallParser(ReplyParser):
    """Helpers for formats that write calls as JSON at some point of the text: one scanner at a time."""

    def __init__(self, new_id: Callable[[], str], tools: frozenset[str]):
        super().__init__(new_id, tools)
        self.scanner: JsonScanner | None = None
        self._scan_from = 0  # where in self.text the scanner's text starts
        self._fed = 0
        self.state = "text"  # each format's own steps; "junk" after a malformed call (see _read_args)

    def _scan(self, at: int) -> JsonScanner:
        self.scanner = JsonScanner()
        self._scan_from = self._fed = at
        return self.scanner

    def _advance(self, final: bool) -> JsonScanner:
        """Feed the scanner what is new; at the end of the text, close a literal still open."""
        sc = self.scanner
        assert sc is not None
        sc.feed(self.text[self._fed :])
        self._fed = len(self.text)
        if final:
            sc.finish()
        return sc

    def _scan_end(self) -> int:
        """Index in self.text just past the scanned value (once the scanner is done)."""
        assert self.scanner is not None
        return self._scan_from + self.scanner.end

    def _read_args(self, final: bool, out: list[Event]) -> bool:
        """Feed the last call's JSON arguments what is new and add their events to `out`. True once they are
        whole (self.cur is then past them). False when reading stops here: more text is needed, or they are
        malformed (self.malformed set, and self.state "junk": nothing after a malformed call is read)."""
        sc = self._advance(final)
        out += self.calls[-1].poll()
        if sc.error or self.calls[-1].rejected:
            self.malformed = True
            self.state = "junk"
            return False
        if not sc.done:
            return False
        self.cur = self._scan_end()
        return True


class ReplyAssembler:
    """Runs one choice's text through the reasoning splitter (for a model that thinks) and the tool-call parser
    (for a request with tools), and decides, at the end, what the reply is. Without a parser the answer is
    plain text."""

    def __init__(
        self,
        parser: ReplyParser | None,
        checker: CallChecker | None = None,
        parallel: bool = True,
        reasoning: ReasoningSplitter | None = None,
        lead: str = "",
    ):
        self.parser = parser
        self._lead = lead  # text the reply is taken to begin with (a thinking block its prompt opened)
        self.checker = checker
        self.parallel = parallel
        self.reasoning = reasoning
        self._content: list[str] = []
        self._held: list[Event] = []  # from the first delta of a call not yet complete on
        self._announced = False  # whether a call's delta went out (a stream cannot take it back)

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        text, self._lead = self._lead + text, ""
        if self.reasoning is None:
            return self._answer(text, final=False)
        thought, answer = self.reasoning.feed(text)
        head: list[Event] = [ReasoningDelta(thought)] if thought else []
        return head + self._answer(answer, final=False)

    def _answer(self, text: str, final: bool) -> list[Event]:
        if self.parser is None:
            self._content.append(text)
            return [TextDelta(text)] if text else []
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        return self._keep(events)

    def finish(self, finish_reason: str) -> tuple[list[Event], Reply]:
        events: list[Event] = []
        thought = None
        if self.reasoning is not None:
            last, answer = self.reasoning.finish()
            events += [ReasoningDelta(last)] if last else []
            events += self._answer(answer, final=self.parser is not None)
            thought = self.reasoning.reasoning or None
        elif self.parser is not None:
            events += self._keep(
                self.parser.finish()
            )  # what is still held belongs to an unfinished call: dropped
        if self.parser is None:
            return events, Reply("".join(self._content), (), finish_reason, thought)
        p = self.parser
        assert self.checker is not None
        unfinished = p.cut or any(not c.complete for c in p.calls)
        # Cut off by max_tokens in the middle of the calls: the calls written in full stand, the unfinished one is
        # dropped (as the stream, which sent each call once it was complete). Otherwise an unfinished call means
        # the model broke off the format, and the reply is its text.
        dropping = finish_reason == "length" and unfinished and not p.malformed
        calls = tuple(
            ToolCall(c.id, c.name or "", c.arguments)
            for c in p.calls
            if c.started and (c.complete or not dropping)
        )
        problem = None
        if dropping and not calls:
            # Cut inside its only call (or its first): no call stands, and an empty reply breaks clients
            # (Anthropic's content[0]), so the text as written is the reply.
            problem = "cut inside its first tool call"
        elif p.malformed:
            problem = "the text does not follow the tool-call format"
        elif unfinished and not dropping:
            problem = "a tool call is incomplete"
        elif len(calls) > 1 and not self.parallel:
            problem = "several tool calls, but parallel_tool_calls is false"
        else:
            problem = next((q for q in map(self.checker.problem, calls) if q), None)
        if problem is not None:
            log.info("a reply is returned as text: %s", problem)
            if not self._announced:  # the stream sends what it held back (the parser trimmed what it said)
                said = "".join(self._content)
                at = p.text.find(said) if said else -1
                rest = p.text[at + len(said) :] if at >= 0 else p.text
                events += [TextDelta(rest)] if rest else []
            return events, Reply(p.text or None, (), finish_reason, thought)
        content = "".join(self._content) or None
        if calls:
            reason = "tool_calls" if finish_reason == "stop" else finish_reason
            return events, Reply(content, calls, reason, thought)
        return events, Reply(content, (), finish_reason, thought)

    def _keep(self, events: list[Event]) -> list[Event]:
        """The events that can go out now, in order: none from a call that is not complete yet."""
        self._content.extend(e.text for e in events if isinstance(e, TextDelta))
        pending, self._held, out = self._held + events, [], []
        for e in pending:
            if self._held or (isinstance(e, CallDelta) and not self.parser.calls[e.index].complete):
                self._held.append(e)
            elif isinstance(e, CallDelta) and e.id is not None:
                out.append(replace(e, id=self.parser.calls[e.index].id))  # an id written after the name
            else:
                out.append(e)
        self._announced = self._announced or any(isinstance(e, CallDelta) for e in out)
        return out
