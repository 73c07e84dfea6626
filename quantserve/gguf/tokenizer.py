"""GGUF tokenizer metadata from an HF tokenizer.json, written the way llama.cpp's convert_hf_to_gguf.py does.

Byte-level BPE follows `get_vocab_base` + `_set_vocab_gpt2` (conversion/base.py), using the `tokenizers`
library instead of transformers; special ids, add_bos/add_eos, merges and the chat template come from
gguf-py's own SpecialVocab. The pre-tokenizer name is the one GGUF→HF saved in tokenizer_config.json, else
llama.cpp's hash of the check text. SentencePiece-style tokenizer.json (BPE with byte fallback) becomes a
"llama" vocab whose scores rank pieces in merge order, which is all llama.cpp's SPM merge loop looks at.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.gguf.pretokenizers import CHECK_TEXT, PRE_TOKENIZER_HASHES, PRE_TOKENIZERS

# llama.cpp token types (gguf-py constants.py TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
PRE_KEY = "gguf_tokenizer_pre"  # our extra tokenizer_config.json key, written by GGUF→HF, read back here

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True, eq=False)
class GGUFVocab:
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    special: gguf.SpecialVocab
    add_space_prefix: bool | None
    # written after the tokens and special ids, as Gemma's set_vocab adds it (its own key, whatever the arch);
    # else before them, where LlamaModel's set_vocab reads it from tokenizer_config.json
    space_prefix_last: bool = False

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        if self.add_space_prefix is not None and not self.space_prefix_last:
            writer.add_add_space_prefix(self.add_space_prefix)
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.token_types)
        self.special.add_to_gguf(writer, quiet=True)
        if self.add_space_prefix is not None and self.space_prefix_last:
            writer.add_add_space_prefix(self.add_space_prefix)


def looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py does_token_look_special: added tokens some models forgot to mark special
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _pre_name(tok: Tokenizer, tokenizer_config: Mapping[str, Any], path: Path) -> str:
    saved = tokenizer_config.get(PRE_KEY)
    if isinstance(saved, str) and saved:
        return saved
    digest = hashlib.sha256(str(tok.encode(CHECK_TEXT).ids).encode()).hexdigest()
    name = PRE_TOKENIZER_HASHES.get(digest)
    if name is None:
        raise UnsupportedFormatError(
            f"{path}: this BPE pre-tokenizer is not one quantserve recognises (check-text hash {digest[:16]}…); "
            f'if you know llama.cpp\'s name for it, add "{PRE_KEY}": "<name>" to tokenizer_config.json '
            f"(known names: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return name


def _bpe_tokens(tok: Tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """convert_hf_to_gguf.py get_vocab_base: every id up to vocab_size, added tokens typed, holes as [PADi]."""
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = reverse[i]
        if i in added:
            if not added[i].normalized:  # llama.cpp assumes added tokens arrive pre-normalized
                token = tok.decode(tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            if added[i].special or looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("▁", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types


def _spm_tokens(
    tok: Tokenizer, model: Mapping[str, Any], unk: str | None, vocab_size: int = 0
) -> tuple[list[str], list[int], list[float]]:
    """Pieces, types and scores by id, padded with unused `[PADi]` to the embedding's `vocab_size` (llama.cpp
    needs a token per row; _create_vocab_sentencepiece pads the same way)."""
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    rank: dict[str, int] = {}
    for r, m in enumerate(model.get("merges") or []):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        rank.setdefault(a + b, r)
    tokens, types, scores = [], [], []
    for i in range(max(max(reverse) + 1, vocab_size)):
        t = reverse.get(i, f"[PAD{i}]")
        tokens.append(t)
        scores.append(-float(rank.get(t, 0)))  # earlier merge = higher score, as SentencePiece ranks pieces
        if i not in reverse:
            types.append(UNUSED)
        elif t == unk:
            types.append(UNKNOWN)
        elif _BYTE_PIECE.fullmatch(t):
            types.append(BYTE)
        elif i in added:
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            types.append(NORMAL)
    return tokens, types, scores


def vocab_from_hf(directory: Path, hparams: Mapping[str, Any]) -> GGUFVocab:
    """Read tokenizer.json (+ tokenizer_config.json, config.json) into the GGUF tokenizer fields.

    Raises:
        ModelFileError: no tokenizer.json, or one that cannot be parsed.
        UnsupportedFormatError: a tokenizer type or pre-tokenizer llama.cpp (or quantserve) cannot use.
    """
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelFileError(
            f"{directory} has no tokenizer.json; copy the model's tokenizer.json (and tokenizer_config.json) "
            "from its original repository into this directory — the GGUF embeds the tokenizer"
        )
    try:
        tok = Tokenizer.from_file(str(path))
        model = json.loads(path.read_text(encoding="utf-8"))["model"]
    except Exception as e:  # the tokenizers library raises bare Exception subclasses
        raise ModelFileError(f"{path}: cannot load the tokenizer ({e}); re-download it") from None
    tc_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    if model.get("type") != "BPE":
        raise UnsupportedFormatError(
            f"{path}: a {model.get('type')} tokenizer; quantserve converts BPE tokenizers only (byte-level or "
            "SentencePiece-style with byte fallback)"
        )
    add_space = tokenizer_config.get("add_prefix_space")
    if model.get("byte_fallback"):
        unk = model.get("unk_token")
        tokens, types, scores = _spm_tokens(tok, model, unk, hparams.get("vocab_size") or 0)
        prepend = "Prepend" in json.dumps((json.loads(tok.to_str()).get("normalizer")) or {})
        special = gguf.SpecialVocab(directory, n_vocab=len(tokens))
        return GGUFVocab("llama", "default", tokens, types, scores, special, prepend)
    tokens, types = _bpe_tokens(tok, hparams.get("vocab_size", tok.get_vocab_size(with_added_tokens=True)))
    special = gguf.SpecialVocab(directory, load_merges=True)
    return GGUFVocab("gpt2", _pre_name(tok, tokenizer_config, path), tokens, types, None, special,
                     add_space if isinstance(add_space, bool) else None)  # fmt: skip
