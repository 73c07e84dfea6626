"""Incremental JSON scanning: where each value of a growing JSON text starts and ends, by its path.

Tool calls stream as JSON one token at a time. To send a call's name as soon as it is complete, and its arguments
in fragments that concatenate to exactly the JSON the model wrote, the parsers need to know, after every token,
which part of the text is which value. JsonScanner reads each character once and keeps a Span per value path:
`("tool_calls", 0, "arguments")` is the "arguments" value of the first element of the root's "tool_calls".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_LITERAL = frozenset("-+.0123456789eEtrufalsn")  # numbers, true, false, null
# what the scanner expects next
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE, _DONE = range(7)

Path = tuple[str | int, ...]


@dataclass
class Span:
    """One value's place in the text: [start, end), `end` None while it is still being written."""

    start: int
    kind: str  # object, array, string, literal
    end: int | None = None


@dataclass
class _Frame:
    kind: str  # object or array
    path: Path
    key: str | int | None = None  # the current key (object) or index (array)


class JsonScanner:
    """Scans one JSON value from a text that grows at its end (call `feed`), recording spans by path.

    Only values at most `max_depth` levels deep get spans. `done` once the root value is complete (`end` is the
    index just past it); `error` once the text cannot be JSON (`error_at` says where). Text after the root value
    is not read: it belongs to whoever called the scanner.
    """

    def __init__(self, max_depth: int = 4):
        self.text = ""
        self.pos = 0  # characters read
        self.spans: dict[Path, Span] = {}
        self.done = False
        self.end = -1
        self.error = False
        self.error_at = -1
        self._max_depth = max_depth
        self._stack: list[_Frame] = []
        self._expect = _VALUE
        self._open: Path | None = None  # the string or literal being read
        self._open_start = -1
        self._in_string = self._in_literal = self._escape = self._is_key = False

    def feed(self, more: str) -> None:
        self.text += more
        t, i, n = self.text, self.pos, len(self.text)
        while i < n and not (self.done or self.error):
            c = t[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    self._end_string(i + 1)
                i += 1
                continue
            if self._in_literal:
                if c in _LITERAL:
                    i += 1
                    continue
                self._end_literal(i)
                continue  # c is read again in the new state
            if c in _WS:
                i += 1
                continue
            self._step(c, i)
            i += 1
        self.pos = i

    def finish(self) -> None:
        """The text is complete: a literal still open at the end (a bare number at the root) ends there."""
        if self._in_literal and not self.error:
            self._end_literal(len(self.text))

    def string_value(self, path: Path) -> str | None:
        """The decoded string at `path` once it is complete; None before, or if that value is not a string."""
        span = self.spans.get(path)
        if span is None or span.end is None or span.kind != "string":
            return None
        return no_lone_surrogates(json.loads(self.text[span.start : span.end], strict=False))

    def partial_string(self, path: Path) -> str | None:
        """The decodable part of the string at `path` so far (the whole string once complete); None if there is
        no string there, or it holds an escape JSON does not know."""
        span = self.spans.get(path)
        if span is None or span.kind != "string":
            return None
        if span.end is not None:
            return no_lone_surrogates(json.loads(self.text[span.start : span.end], strict=False))
        raw = self.text[span.start + 1 : self.pos]
        try:
            return no_lone_surrogates(json.loads('"' + _complete_escapes(raw) + '"', strict=False))
        except json.JSONDecodeError:  # a bad escape: not JSON, and the parser finds out at the end
            return None

    # ---- the state machine ----------------------------------------------------------------------

    def _fail(self, i: int) -> None:
        self.error, self.error_at = True, i

    def _path(self) -> Path:
        """The path of the value that starts next."""
        if not self._stack:
            return ()
        top = self._stack[-1]
        return (*top.path, top.key)

    def _begin(self, path: Path, i: int, kind: str) -> None:
        if len(path) <= self._max_depth:
            self.spans[path] = Span(i, kind)

    def _close(self, path: Path, end: int) -> None:
        span = self.spans.get(path)
        if span is not None:
            span.end = end
        if not self._stack:
            self.done, self.end, self._expect = True, end, _DONE
        else:
            self._expect = _COMMA_OR_CLOSE

    def _step(self, c: str, i: int) -> None:
        exp = self._expect
        if exp in (_VALUE, _VALUE_OR_CLOSE):
            if exp == _VALUE_OR_CLOSE and c == "]":
                self._close_container("array", i)
            else:
                self._start_value(c, i)
        elif exp in (_KEY, _KEY_OR_CLOSE):
            if exp == _KEY_OR_CLOSE and c == "}":
                self._close_container("object", i)
            elif c == '"':
                self._in_string, self._is_key, self._open_start = True, True, i
            else:
                self._fail(i)
        elif exp == _COLON:
            if c == ":":
                self._expect = _VALUE
            else:
                self._fail(i)
        elif exp == _COMMA_OR_CLOSE:
            top = self._stack[-1]
            if c == ",":
                if top.kind == "object":
                    self._expect = _KEY
                else:
                    top.key += 1
                    self._expect = _VALUE
            elif c in "}]":
                self._close_container("object" if c == "}" else "array", i)
            else:
                self._fail(i)

    def _start_value(self, c: str, i: int) -> None:
        path = self._path()
        if c in "{[":
            kind = "object" if c == "{" else "array"
            self._begin(path, i, kind)
            self._stack.append(_Frame(kind, path, None if kind == "object" else 0))
            self._expect = _KEY_OR_CLOSE if kind == "object" else _VALUE_OR_CLOSE
        elif c == '"':
            self._begin(path, i, "string")
            self._in_string, self._is_key, self._open, self._open_start = True, False, path, i
        elif c in _LITERAL:
            self._begin(path, i, "literal")
            self._in_literal, self._open, self._open_start = True, path, i
        else:
            self._fail(i)

    def _close_container(self, kind: str, i: int) -> None:
        top = self._stack[-1]
        if top.kind != kind:
            self._fail(i)
            return
        self._stack.pop()
        self._close(top.path, i + 1)

    def _end_string(self, end: int) -> None:
        if self._is_key:
            try:
                self._stack[-1].key = json.loads(self.text[self._open_start : end])
            except json.JSONDecodeError:
                self._fail(self._open_start)
                return
            self._expect = _COLON
        else:
            self._close(self._open, end)

    def _end_literal(self, end: int) -> None:
        self._in_literal = False
        try:
            json.loads(self.text[self._open_start : end])
        except json.JSONDecodeError:
            self._fail(self._open_start)
            return
        self._close(self._open, end)


def no_lone_surrogates(text: str) -> str:
    """JSON may escape half a surrogate pair (\\ud83d alone), which no UTF-8 can carry: it becomes U+FFFD."""
    if not any("\ud800" <= c <= "\udfff" for c in text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _complete_escapes(raw: str) -> str:
    """`raw` (a string's inside, still being written) cut before an escape that cannot be decoded yet: a lone
    backslash, a \\u with fewer than four hex digits, or a high surrogate still waiting for its low half."""
    while True:
        last = raw.rfind("\\")
        if last == -1:
            return raw
        first = last
        while first > 0 and raw[first - 1] == "\\":
            first -= 1
        if (last - first + 1) % 2 == 0:  # pairs of backslashes only: no escape is open
            return raw
        rest = raw[last + 1 :]
        if rest[:1] != "u" and rest:
            return raw
        if rest and len(rest) >= 5:
            try:
                code = int(rest[1:5], 16)
            except ValueError:
                return raw  # not an escape JSON knows; json.loads says so
            if not (0xD800 <= code <= 0xDBFF and len(rest) == 5):
                return raw
        raw = raw[:last]
