"""Incremental detokenization with stop strings: bytes in, safe-to-emit text out."""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    """Turns a stream of token byte pieces into text deltas.

    UTF-8 characters split across tokens are held until complete. Text that could be the start of a stop string
    is held back until it either completes the stop (then it is dropped, as OpenAI does) or diverges from it.
    """

    def __init__(self, stop: tuple[str, ...] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._pending = ""
        self.hit: str | None = None  # the stop string found, once one is

    def add(self, piece: bytes) -> tuple[str, bool]:
        """Feed one token's bytes. Returns (text to emit now, whether a stop string was hit)."""
        self._pending += self._decoder.decode(piece)
        if not self._stop:
            out, self._pending = self._pending, ""
            return out, False
        hit = -1
        for s in self._stop:
            i = self._pending.find(s)
            if i != -1 and (hit == -1 or i < hit):
                hit, self.hit = i, s
        if hit != -1:
            out, self._pending = self._pending[:hit], ""
            return out, True
        keep = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._pending)), keep, -1):
                if self._pending.endswith(s[:k]):
                    keep = k
                    break
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """Text still held back when the sequence ends without a stop string."""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out
