"""Rebuild an HF fast tokenizer (tokenizer.json + tokenizer_config.json) from a GGUF's tokenizer metadata.

Target: the HF tokenizer gives the same ids as llama.cpp on the same GGUF (docs/gguf.md, "How the HF
tokenizer and llama.cpp agree"). Byte-level BPE
("gpt2") uses llama.cpp's split regexes for `tokenizer.ggml.pre` (pretokenizers.py); SentencePiece ("llama")
becomes the BPE-with-byte-fallback layout transformers itself writes for Llama-2 (convert_slow_tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from quantserve.errors import UnsupportedFormatError
from quantserve.gguf.pretokenizers import PRE_TOKENIZERS
from quantserve.gguf.tokenizer import CONTROL, NORMAL, PRE_KEY, UNKNOWN, UNUSED, USER_DEFINED

_SPECIAL_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
}


@dataclass(frozen=True, eq=False)
class HFTokenizer:
    """Everything an HF tokenizer directory needs, ready to write."""

    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, Any]

    def save(self, directory: Path) -> None:
        self.tokenizer.save(str(directory / "tokenizer.json"))
        for name, obj in (
            ("tokenizer_config.json", self.tokenizer_config),
            ("special_tokens_map.json", self.special_tokens_map),
        ):
            (directory / name).write_text(
                json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )


def _added(content: str, special: bool, normalized: bool = False) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": normalized, "rstrip": False, "single_word": False,
            "special": special}  # fmt: skip


def _spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by SentencePiece scores, the way transformers' SentencePieceExtractor derives them:
    every split of a piece into two known pieces, ordered by the merged piece's score (higher first)."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                found.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    found.sort()  # score first, then piece id, then the two halves' ids: the extractor's two stable sorts
    return [(a, b) for *_, a, b in found]


def _gpt2_model(md: Mapping[str, Any], vocab: dict[str, int], pre_name: str) -> tuple[Tokenizer, bool]:
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise UnsupportedFormatError(
            f"tokenizer.ggml.pre '{pre_name}' is not one quantserve can rebuild as an HF tokenizer "
            f"(known: {known}); convert from the original HF checkpoint instead"
        )
    merges = []
    for m in md.get("tokenizer.ggml.merges") or []:
        i = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        merges.append((m[:i], m[i + 1 :]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, pre.clean_spaces


def _spm_model(md: Mapping[str, Any], vocab: dict[str, int], unk: str | None) -> Tokenizer:
    scores = md.get("tokenizer.ggml.scores") or [0.0] * len(vocab)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=_spm_merges(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    # llama.cpp puts one space before the text and after every special token; HF's per-segment
    # Prepend normalizer does the same (transformers' "legacy" Llama tokenizer layout)
    add_space = md.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if add_space else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tail = [decoders.Strip(" ", 1, 0)] if add_space else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail]
    )
    return tok


def tokenizer_from_gguf(md: Mapping[str, Any], model_max_length: int | None = None) -> HFTokenizer:
    """Build the HF tokenizer files from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

    Raises:
        UnsupportedFormatError: no token list, a tokenizer model other than "gpt2"/"llama", or a
            pre-tokenizer name this module has no regexes for.
    """
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = list(md.get("tokenizer.ggml.tokens") or [])
    if kind not in ("gpt2", "llama") or not tokens:
        raise UnsupportedFormatError(
            f"tokenizer.ggml.model is {kind!r} with {len(tokens)} tokens; quantserve rebuilds only 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece) vocabularies — use the original HF tokenizer files"
        )
    types: list[int] = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types, strict=False)):
        # UNUSED ids are the holes convert_hf_to_gguf.py filled with "[PADi]": leave them holes again.
        # llama.cpp keeps every id; in HF a duplicate piece is reachable by its first id only.
        if ty != UNUSED:
            vocab.setdefault(t, i)
    special = {k: md.get(f"tokenizer.ggml.{v}") for k, v in _SPECIAL_KEYS.items()}
    names = {k: tokens[i] for k, i in special.items() if isinstance(i, int) and 0 <= i < len(tokens)}
    pre_name = str(md.get("tokenizer.ggml.pre") or "default")
    if kind == "gpt2":
        tok, clean_spaces = _gpt2_model(md, vocab, pre_name)
        default_bos = PRE_TOKENIZERS[pre_name].add_bos
    else:
        tok, clean_spaces, default_bos = _spm_model(md, vocab, names.get("unk")), False, True

    added: dict[str, dict[str, Any]] = {}
    for i, (t, ty) in enumerate(zip(tokens, types, strict=False)):
        if ty in (CONTROL, UNKNOWN, USER_DEFINED) and vocab.get(t) == i:
            # a byte-level user-defined token is stored as text ("ø"), not byte symbols: normalized=True keeps
            # convert_hf_to_gguf.py from decoding it as bytes on the way back (its get_vocab_base)
            added[str(i)] = _added(t, ty != USER_DEFINED, normalized=ty == USER_DEFINED and kind == "gpt2")
    tok.add_tokens(
        [AddedToken(a["content"], special=a["special"], normalized=a["normalized"]) for a in added.values()]
    )

    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", default_bos)) and "bos" in names
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and "eos" in names
    if add_bos or add_eos:
        first = [f"{names['bos']}:0"] if add_bos else []
        last = [f"{names['eos']}:0"] if add_eos else []
        ids = [(names[k], special[k]) for k, on in (("bos", add_bos), ("eos", add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(
            single=[*first, "$A:0", *last],
            pair=[*first, "$A:0", *last, *[s.replace(":0", ":1") for s in first], "$B:1", *[s.replace(":0", ":1") for s in last]],
            special_tokens=ids,
        )  # fmt: skip
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "add_bos_token": add_bos,
        # only when the GGUF says, so that HF→GGUF writes back exactly the keys it found
        **({"add_eos_token": add_eos} if "tokenizer.ggml.add_eos_token" in md else {}),
        "added_tokens_decoder": added,
        **{f"{k}_token": v for k, v in names.items()},
        "clean_up_tokenization_spaces": clean_spaces,
        "model_max_length": model_max_length or 1_000_000_000_000_000_019_884_624_838_656,  # HF's "no limit"
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.ggml.add_space_prefix" in md and kind == "gpt2":
        config["add_prefix_space"] = bool(md["tokenizer.ggml.add_space_prefix"])
    if isinstance(md.get("tokenizer.chat_template"), str):
        config["chat_template"] = md["tokenizer.chat_template"]
    if kind == "gpt2":
        config[PRE_KEY] = pre_name  # what HF→GGUF writes back as tokenizer.ggml.pre
    stm = {
        f"{k}_token": {key: v for key, v in _added(t, True).items() if key != "special"}
        for k, t in names.items()
    }
    return HFTokenizer(tok, config, stm)
