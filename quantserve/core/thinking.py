"""A thinking budget, enforced by the engine on both backends: after `budget` tokens of reasoning it writes the
family's end marker into the sequence itself, one token per step, and the model goes on to answer after it.

The markers are watched as bytes of the tokens' text (control tokens by their text), so a marker written in
several tokens is seen as well as one that is a single token. The forced tokens pass through the request's
grammar like any other: a grammar for a thinking model allows the end marker anywhere in its reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingSpec:
    """One request's reasoning block: its markers, whether the prompt opened it, the budget (None: unbounded)
    and the tokens forced when the budget is spent (the end marker as the template writes it)."""

    start: bytes
    end: bytes
    opened: bool
    budget: int | None
    forced: tuple[int, ...]


class ThinkState:
    """Where one sequence is: before a block, inside it (counting its tokens), forcing its end, or past it."""

    def __init__(self, spec: ThinkingSpec):
        self.spec = spec
        self.count = 0  # reasoning tokens so far
        self._tail = b""
        self._window = max(len(spec.start), len(spec.end)) + 64
        self._queue: list[int] = []
        self.state = "idle"
        if spec.opened:
            self._enter()

    def _enter(self) -> None:
        self.state = "thinking"
        self._tail = b""
        if self.spec.budget is not None and self.spec.budget <= 0:
            self._force()

    def _force(self) -> None:
        self.state = "forcing"
        self._queue = list(self.spec.forced)

    @property
    def forcing(self) -> bool:
        return bool(self._queue)

    def next_token(self, sampled: int) -> int:
        """The token the sequence takes: the sampled one, or the next of the end marker being forced."""
        return self._queue.pop(0) if self._queue else sampled

    def observe(self, piece: bytes) -> None:
        """After a token is taken: its text (control tokens by their text)."""
        self._tail = (self._tail + piece)[-self._window :]
        if self.state == "idle":
            if self.spec.start in self._tail:
                self._enter()
        elif self.state == "thinking":
            self.count += 1
            if self.spec.end in self._tail:
                self.state = "done"
            elif self.spec.budget is not None and self.count >= self.spec.budget:
                self._force()
        elif self.state == "forcing" and not self._queue:
            self.state = "done"
