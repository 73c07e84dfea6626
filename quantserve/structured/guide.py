"""Token masks from a grammar: a Guide follows one sequence's output through its grammar (an llguidance matcher)
and says, before each sampling step, which tokens may come next.

The vocabulary is described to llguidance once per model, as bytes per token: text tokens by the bytes they print,
control tokens (`<|im_end|>`, `[TOOL_CALLS]`) by their text behind a 0xFF byte, which llguidance reads as "only
this token, never as text" (its llama.cpp binding marks them the same way). A grammar can then ask for a control
token by id. The end-of-generation tokens are allowed exactly when the grammar is complete.

A mask is one bit per token, 32 tokens per int32 (llguidance's layout). Computing one costs tens of microseconds
for SmolLM2's 49k tokens, and applying it to a row of logits about as much: far below a decode step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

from quantserve.errors import InvalidRequestError
from quantserve.structured.grammars import Grammar

log = logging.getLogger("quantserve.structured")


@dataclass(frozen=True)
class Vocabulary:
    """What llguidance needs to know of a model's tokenizer."""

    pieces: Sequence[bytes]  # token id -> the bytes it prints; for a control token, its text
    control: frozenset[int]  # tokens that never stand for text (chat markers, EOS, …)
    eog: tuple[int, ...]  # tokens that end generation
    tokenize: Callable[[str], list[int]]  # plain text -> ids, control-token text left as text


class _Tokenizer:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads."""

    def __init__(self, vocab: Vocabulary, n_vocab: int):
        self.tokens = [b"\xff" + p if i in vocab.control else p for i, p in enumerate(vocab.pieces)]
        self.tokens += [b""] * (n_vocab - len(self.tokens))  # ids the model has and the tokenizer never makes
        self.eos_token_id = vocab.eog[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(vocab.control)
        self._tokenize = vocab.tokenize

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenize(text)


class GuideCompiler:
    """One model's vocabulary in llguidance form; makes a Guide per constrained sequence. Thread-safe."""

    def __init__(self, vocab: Vocabulary, n_vocab: int):
        if not vocab.eog:
            raise ValueError("the vocabulary has no end-of-generation token")
        self.n_vocab = n_vocab  # rows of logits, which may be wider than the tokenizer
        self.mask_words = (n_vocab + 31) // 32
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Tokenizer(vocab, n_vocab)),
            n_vocab=n_vocab,
            eos_token=list(vocab.eog),
        )
        # control token text -> id, for grammars that name a chat marker ("[TOOL_CALLS]")
        self.special = {
            vocab.pieces[i].decode("utf-8", "replace"): i for i in sorted(vocab.control, reverse=True)
        }

    def guide(self, grammar: Grammar) -> Guide:
        """A fresh Guide at the start of `grammar`.

        Raises:
            InvalidRequestError: llguidance rejects the grammar (a schema it cannot express, a bad Lark rule).
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar.source, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"'{grammar.param}' cannot be enforced: {matcher.get_error()}", param=grammar.param
            )
        if grammar.prefix and not matcher.consume_tokens(self.tokenizer.tokenize_str(grammar.prefix)):
            raise InvalidRequestError(
                f"the text the reply continues ({grammar.prefix[:40]!r}) does not fit '{grammar.param}'",
                param="messages",
            )
        return Guide(matcher, self.mask_words, self.n_vocab)


class Guide:
    """Where one sequence is in its grammar. Used by the engine thread only, once the request is queued."""

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab
        self._row = np.zeros(mask_words, dtype=np.int32)

    def fill(self, row: np.ndarray) -> None:
        """Write the mask of tokens allowed next into `row` (int32 [mask_words], C-contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits [n_vocab] of every token the grammar forbids now to -inf, in place."""
        self.fill(self._row)
        apply_mask(logits, self._row)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the guide is then broken)."""
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        return self.matcher.get_error()


_executor: llguidance.LLExecutor | None = None


def fill_masks(guides: list[Guide], out: np.ndarray) -> None:
    """Masks for several guides at once into out [len(guides), mask_words] (int32), in parallel threads."""
    global _executor
    if len(guides) == 1:
        guides[0].fill(out[0])
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr(
        [(g.matcher, i) for i, g in enumerate(guides)], out.ctypes.data, out.shape[1] * 4, out.shape[0]
    )


def allowed(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """The mask row as booleans [n_vocab] (bit j of word i is token 32 i + j)."""
    return np.unpackbits(mask.view(np.uint8), bitorder="little", count=n_vocab).view(bool)


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> None:
    """logits [V] of the tokens `mask` forbids become -inf, in place."""
    logits[~allowed(mask, logits.shape[0])] = -np.inf
