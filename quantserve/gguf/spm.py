"""A SentencePiece `tokenizer.model` as llama.cpp's converter reads it, without the sentencepiece library.

The file is a protobuf `ModelProto`; its field 1 repeats `SentencePiece {piece = 1 (string), score = 2 (float),
type = 3 (enum: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6)}` (sentencepiece_model.proto).
Those three are all that `_create_vocab_sentencepiece` (convert_hf_to_gguf.py, conversion/base.py) takes from it;
the vocab below follows that function: pieces by id padded to config.json's vocab_size, then added_tokens.json and
tokenizer_config.json's added tokens over them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf

from quantserve.errors import ModelFileError
from quantserve.gguf.tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    GGUFVocab,
    looks_special,
)

MAX_BYTES = 64 << 20  # Gemma's tokenizer.model is 4 MB
MAX_PIECES = 1 << 21  # the largest vocabularies have 262k pieces
_TYPES = {
    2: UNKNOWN,
    3: CONTROL,
    5: UNUSED,
    6: BYTE,
}  # llama.cpp keeps these; the rest (user-defined too) NORMAL


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("a truncated varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of one message: an int, or the bytes of the others."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"wire type {wire} (field {field})")
        if i > len(buf):
            raise ValueError(f"field {field} runs past the end")
        yield field, wire, value


def read_pieces(path: Path) -> list[tuple[str, float, int]]:
    """(piece, score, SentencePiece type) by id.

    Raises:
        ModelFileError: not a SentencePiece model (malformed protobuf, no pieces, too large).
    """
    if path.stat().st_size > MAX_BYTES:
        raise ModelFileError(
            f"{path}: {path.stat().st_size} bytes is not a SentencePiece model (at most 64 MiB)"
        )
    pieces = []
    try:
        for field, wire, value in _fields(path.read_bytes()):
            if field != 1 or wire != 2:
                continue
            piece, score, kind = "", 0.0, 1
            for f, w, v in _fields(value):
                if f == 1 and w == 2:
                    piece = v.decode("utf-8")
                elif f == 2 and w == 5:
                    score = struct.unpack("<f", v)[0]
                elif f == 3 and w == 0:
                    kind = v
            pieces.append((piece, score, kind))
            if len(pieces) > MAX_PIECES:
                raise ValueError(f"more than {MAX_PIECES} pieces")
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise ModelFileError(
            f"{path}: not a SentencePiece model ({e}); re-download tokenizer.model"
        ) from None
    if not pieces:
        raise ModelFileError(f"{path}: a SentencePiece model with no pieces; re-download tokenizer.model")
    return pieces


def spm_vocab(directory: Path, hparams: Mapping[str, Any], *, space_prefix: bool | None = None) -> GGUFVocab:
    """The "llama" (SentencePiece) vocab of `directory`'s tokenizer.model, as _set_vocab_sentencepiece writes it;
    `space_prefix`: the add_space_prefix key an arch's set_vocab writes after it (Gemma: False).

    Raises:
        ModelFileError: a malformed tokenizer.model, added_tokens.json or tokenizer_config.json.
    """
    pieces = read_pieces(directory / "tokenizer.model")
    n = hparams.get("vocab_size") or len(pieces)
    tokens, scores, types = [f"[PAD{i}]" for i in range(n)], [-10000.0] * n, [UNUSED] * n
    for i, (piece, score, kind) in enumerate(pieces[:n]):
        tokens[i], scores[i], types[i] = piece, score, _TYPES.get(kind, NORMAL)
    for token, i in _json(directory / "added_tokens.json").items():
        if isinstance(i, int) and 0 <= i < n:
            tokens[i], scores[i], types[i] = token, -1000.0, USER_DEFINED
    decoder = _json(directory / "tokenizer_config.json").get("added_tokens_decoder")
    for key, data in (decoder if isinstance(decoder, dict) else {}).items():
        try:
            i, content = int(key), data["content"]
        except (ValueError, TypeError, KeyError):
            continue
        if not isinstance(content, str) or not 0 <= i < n:
            continue
        if data.get("special") or looks_special(content):
            types[i] = CONTROL
        else:
            content, types[i] = content.replace("\u2581", " "), USER_DEFINED  # pre-normalised spaces
        tokens[i], scores[i] = content, -1000.0
    special = gguf.SpecialVocab(directory, n_vocab=n)
    return GGUFVocab("llama", "default", tokens, types, scores, special, space_prefix, space_prefix_last=True)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ModelFileError(f"{path}: cannot parse JSON ({e}); fix or re-download the file") from None
    return value if isinstance(value, dict) else {}
