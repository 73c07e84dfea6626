"""Reasoning ("thinking") in a model's replies: how its template marks it, and the splitting of a reply into its
reasoning and its answer as it streams.

The format is read from the template, never from the model's name. A probe render writes an assistant turn that
holds both a known reasoning text and a known answer (under every key templates read it from:
`reasoning_content`, `reasoning`, `thinking`, `thought`, or a `thinking` content block) and takes the markers
around the reasoning: `<think>`…`</think>` for Qwen3, DeepSeek, GLM, Kimi and MiniMax, `[THINK]`…`[/THINK]` for
Ministral, `<seed:think>` for Seed-OSS, and harmony's analysis channel for gpt-oss. A template that drops
reasoning from its history is read from the empty block it writes when thinking is off (Gemma 4), or from a known
marker its generation prompt opens (DeepSeek-R1's distills) or its source names. Renders of the generation prompt
then tell whether the prompt opens the block itself (the reply starts inside it) and whether the template reads
`enable_thinking`.

Then, per reply, ReasoningSplitter parts its reasoning from its answer as it streams. A request's controls are in
quantserve.chat.reasoning_request, and the engine's side, the budget, in quantserve.core.thinking.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from quantserve.errors import ChatTemplateError

if TYPE_CHECKING:
    from quantserve.chat.template import ChatTemplate

PROBE_THOUGHT = "probe thought 5e1d"
PROBE_ANSWER = "probe answer 5e1d"

# Known start markers and their ends, for templates that do not write reasoning back into their history.
KNOWN = {
    "<think>": "</think>",
    "<seed:think>": "</seed:think>",
    "[THINK]": "[/THINK]",
    "<thinking>": "</thinking>",
    "<|START_THINKING|>": "<|END_THINKING|>",
}
_CLOSING = re.compile(r"<\|(?:[A-Za-z_]*(?:END|end)[A-Za-z_]*|eom)\|>")  # <|end|>, <|END_THINKING|>, <|eom|>
# Names shown in `inspect`, /v1/models and logs, by start marker.
NAMES = {
    "<think>": "think",
    "<seed:think>": "seed-oss",
    "[THINK]": "mistral",
    "<thinking>": "thinking-tags",
    "<|channel|>analysis<|message|>": "harmony",
    "<|START_THINKING|>": "command-r",
    "<|channel>thought": "gemma4",
    "<mm:think>": "minimax-m3",
    "<think:opensource>": "hunyuan",
    "<|inner_prefix|>": "apertus",
    "<|think|>": "solar",
    "Here are my reasoning steps:": "apriel",
}

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking", "thought")


@dataclass(frozen=True)
class ReasoningFormat:
    """How a template's replies hold reasoning.

    `start` and `end` are the markers (whitespace stripped); `open_text` and `close_text` are what the template
    writes around an empty block, whitespace included, so that `open_text + close_text` is an empty block as the
    template spells it (how thinking is switched off where the template has no switch of its own). `opened`: the
    generation prompt ends inside a block. `switch`: the template reads `enable_thinking`.
    """

    name: str
    start: str
    end: str
    open_text: str
    close_text: str
    opened: bool
    switch: bool
    # what a new message's header looks like when the answer is a message of its own after the reasoning's
    # (harmony: `<|start|>assistant<|channel|>final<|message|>`): dropped from the answer
    answer_header: str = ""

    @property
    def answer_end(self) -> str:
        """The tag that closes an answer opened by `<|START_X|>` (Cohere's <|END_TEXT|>), dropped with it."""
        m = re.fullmatch(r"<\|START_(\w+)\|>", self.answer_header)
        return f"<|END_{m.group(1)}|>" if m else ""

    @property
    def header_re(self) -> re.Pattern[str] | None:
        """The answer header, allowing what harmony writes between the channel and `<|message|>`."""
        if not self.answer_header:
            return None
        head, sep, _ = self.answer_header.rpartition("<|message|>")
        if not sep:
            return re.compile(re.escape(self.answer_header))
        return re.compile(re.escape(head) + r"[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>")

    def describe(self) -> str:
        how = [f"{self.start}…{self.end}"]
        if self.opened:
            how.append("opened by the prompt")
        if self.switch:
            how.append("enable_thinking")
        return f"{self.name} ({', '.join(how)})"

    def opened_in(self, prompt: str) -> bool:
        """Whether `prompt` ends inside a reasoning block (its last start marker has no end after it)."""
        at = prompt.rfind(self.start)
        return at != -1 and prompt.find(self.end, at + len(self.start)) == -1

    @property
    def empty_block(self) -> str:
        return self.open_text + self.close_text


def detect_reasoning(template: ChatTemplate) -> ReasoningFormat | None:
    """The template's reasoning format, or None when it knows no reasoning (see the module's docstring)."""
    user = {"role": "user", "content": "probe question"}

    def render(messages, gen: bool, **kw) -> str | None:
        try:
            return template.render(
                messages, add_generation_prompt=gen, enable_thinking=True, thinking=True, **kw
            )
        except ChatTemplateError:
            return None

    head = render([user], True)
    if head is None:
        return None
    base = render([user], False) or ""
    markers = _from_history(render, user, base)
    try:
        off = template.render([user], add_generation_prompt=True, enable_thinking=False, thinking=False)
    except ChatTemplateError:
        off = head
    try:
        base_off = template.render([user], add_generation_prompt=False, enable_thinking=False, thinking=False)
    except ChatTemplateError:
        base_off = base
    gen_on = head[len(os.path.commonprefix([base, head])) :]
    gen_off = off[len(os.path.commonprefix([base_off, off])) :]
    markers = markers or _from_switch(gen_on, gen_off) or _from_known(head, template.source)
    if markers is None:
        return None
    start, end, open_text, close_text = markers
    if not start:
        start = gen_on.strip().rsplit("\n", 1)[-1].strip()
        open_text = start + "\n"
        if not start:
            return None
    header = ""
    closing = _CLOSING.match(end)
    if closing is not None and closing.end() < len(end):
        # the block's own end tag, then the answer's opening (harmony's final-channel header, Cohere's
        # <|START_TEXT|>): the reasoning ends at the tag, and the opening is dropped from the answer
        end, header = end[: closing.end()], end[closing.end() :]
    fmt = ReasoningFormat(
        name=NAMES.get(start, "custom"),
        start=start,
        end=end,
        open_text=open_text,
        close_text=close_text,
        opened=False,
        switch=off != head,
        answer_header=header,
    )
    return replace(fmt, opened=fmt.opened_in(gen_on))


def _from_history(render, user, base) -> tuple[str, str, str, str] | None:
    """Markers from an assistant turn that holds PROBE_THOUGHT before PROBE_ANSWER (`base`: the prompt up to
    that turn). The start marker is where that turn departs from a turn with the answer alone, taken from the
    beginning of the marker it departs in (`<|channel|>analysis…` against `<|channel|>final…`)."""
    keyed = {"role": "assistant", "content": PROBE_ANSWER, **dict.fromkeys(REASONING_KEYS, PROBE_THOUGHT)}
    blocks = [{"type": "thinking", "thinking": PROBE_THOUGHT}, {"type": "text", "text": PROBE_ANSWER}]
    apertus = {
        "blocks": [{"type": "thoughts", "text": PROBE_THOUGHT}, {"type": "response", "text": PROBE_ANSWER}]
    }
    plain = render([user, {"role": "assistant", "content": PROBE_ANSWER}], False) or ""
    plain_turn = plain[len(os.path.commonprefix([base, plain])) :]
    for assistant in (
        keyed,
        {"role": "assistant", "content": blocks},
        {"role": "assistant", "content": apertus},
    ):
        full = render([user, assistant], False)
        if full is None or PROBE_THOUGHT not in full:
            continue
        turn = full[len(os.path.commonprefix([base, full])) :]
        t = turn.find(PROBE_THOUGHT)
        a = turn.find(PROBE_ANSWER, t)
        if a == -1 or "'type'" in turn or '"type"' in turn:
            continue  # not rendered as reasoning: the content blocks printed as data
        k = len(os.path.commonprefix([turn[:t], plain_turn]))
        while k > 0 and turn[k] not in "<[" and not turn[k - 1].isspace():
            k -= 1
        open_text, between = turn[k:t].lstrip(), turn[t + len(PROBE_THOUGHT) : a]
        start, end = open_text.strip(), between.strip()
        if not start and end and plain_turn[k:].lstrip().startswith(end):
            # the answer alone is written after an empty block (Qwen3): the start is the tag before the reasoning
            tag = re.search(r"(<[^<>]*>|\[[^\[\]]*\])\s*$", turn[:t])
            if tag is not None:
                open_text, start = turn[tag.start() : t], tag.group(1)
        if end:
            return start, end, open_text, between  # no start: the generation prompt writes it (Apriel 1.6)
    return None


def _from_switch(head: str, off: str) -> tuple[str, str, str, str] | None:
    """Markers from the empty block a template writes into its generation prompt when thinking is off
    (Gemma 4's `<|channel>thought\n<channel|>`), split at its first whitespace."""
    if not off.startswith(head) or off == head:
        return None
    block = off[len(head) :]
    parts = block.strip().split(None, 1)
    if len(parts) != 2:
        return None
    start, end = parts
    split = block.index(start) + len(start)
    return start, end, block[:split], block[split:]


def _from_known(head: str, source: str) -> tuple[str, str, str, str] | None:
    """A known marker pair that the generation prompt opens, or that the template's source names."""
    tail = head.rstrip()
    for start, end in KNOWN.items():
        if tail.endswith(start):
            return start, end, head[head.rfind(start) :], f"\n{end}\n\n"
    for start, end in KNOWN.items():
        if start in source and end in source:
            return start, end, f"{start}\n", f"\n{end}\n\n"
    return None


def holdback(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could be the start of a marker (so it is not sent yet)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ReasoningSplitter:
    """Splits one reply, as it streams, into reasoning and the text after it.

    A reply whose prompt opened a block (`opened`) starts in its reasoning; any other reply starts in reasoning
    only if it opens a block itself, first thing. The reasoning ends at the end marker; a reply that never writes
    it was all reasoning (cut off by max_tokens, or a model that stopped while thinking), as llama.cpp reads it.
    Whitespace around the reasoning and at the start of the answer is dropped.
    """

    def __init__(self, fmt: ReasoningFormat, opened: bool, calls: tuple[str, ...] = ()):
        self.fmt = fmt
        # a tool call's start ends the reasoning too, if the end marker never comes: calls written inside a block
        # that then closes are the reasoning's (llama.cpp reads both so); what follows such a start is held
        self.calls = calls
        self.state = "reasoning" if opened else "start"
        self.buf = ""
        self.reasoning = ""  # all of it, once finished
        self._fresh = True  # at the reasoning's start: its leading blanks and a repeated marker are dropped
        self._strip_answer = opened  # the answer after a block starts at its first non-blank character
        self._closed = False  # the answer's closing tag has come (Cohere's <|END_TEXT|>)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer text) that can go out now."""
        self.buf += text
        reasoning = answer = ""
        if self.state == "start":
            rest = self.buf.lstrip()
            if rest.startswith(self.fmt.start):
                self.buf = rest[len(self.fmt.start) :]
                self.state = "reasoning"
                self._strip_answer = True
            elif rest.startswith(self.fmt.end):  # an empty block whose start the model left out
                self.buf = rest
                self.state = "reasoning"
                self._strip_answer = True
            elif not final and (not rest or any(m.startswith(rest) for m in (self.fmt.start, self.fmt.end))):
                return "", ""
            else:
                self.state = "answer"
        if self.state == "reasoning":
            if self._fresh:
                rest = self.buf.lstrip()
                if rest.startswith(self.fmt.start):
                    rest = rest[len(self.fmt.start) :].lstrip()
                elif not final and (not rest or self.fmt.start.startswith(rest)):
                    return "", ""
                self.buf = rest
                self._fresh = not rest
            at = self.buf.find(self.fmt.end)
            call = min((k for m in self.calls if (k := self.buf.find(m)) != -1), default=-1)
            if call != -1 and at == -1:
                reasoning = self.buf[:call].rstrip()
                self.buf = self.buf[len(reasoning) :]
                if final:  # no end marker: the reasoning ended where the calls began
                    self.state = "answer"
                    self._strip_answer = True
            elif at != -1:
                reasoning = self.buf[:at].rstrip()
                self.buf = self.buf[at + len(self.fmt.end) :]
                self.state = "answer"
            else:
                keep = 0 if final else holdback(self.buf, (self.fmt.end, *self.calls))
                body = self.buf[: len(self.buf) - keep]
                sent = body if final else body.rstrip()  # trailing whitespace waits: it may precede the end
                reasoning, self.buf = sent, self.buf[len(sent) :]
            self.reasoning += reasoning
        if self.state == "answer":
            answer, self.buf = self.buf, ""
            closing = self.fmt.answer_end
            if closing:  # the answer's own closing tag, and anything after it, is no part of it
                if self._closed:
                    answer = ""
                elif closing in answer:
                    answer, self._closed = answer[: answer.index(closing)], True
                elif not final and (keep := holdback(answer, (closing,))):
                    answer, self.buf = answer[:-keep], answer[-keep:]
            if self._strip_answer:
                answer = answer.lstrip()
                header = self.fmt.header_re
                if header is not None:
                    if not final and answer and self._may_be_header(answer):
                        self.buf = answer + self.buf  # the header may still be coming
                        return reasoning, ""
                    m = header.match(answer)
                    answer = answer[m.end() :].lstrip() if m else answer
                self._strip_answer = not answer
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)

    def _may_be_header(self, answer: str) -> bool:
        """Whether `answer` may still turn out to begin with the answer's header: a prefix of its fixed part, or
        (harmony) that part with the rest of the header not yet written up to `<|message|>`."""
        fixed, sep, _ = self.fmt.answer_header.partition("<|message|>")
        if fixed.startswith(answer):
            return True
        return bool(sep) and answer.startswith(fixed) and sep not in answer and len(answer) < 200
