"""HFTokenizer: an HF checkpoint's tokenizer (tokenizer.json + configs) with the llama.cpp backend's semantics.

The ids come from the `tokenizers` library. Everything around them follows what llama.cpp does with the GGUF
that llama.cpp's convert_hf_to_gguf.py (or our quantserve/gguf/tokenizer.py) makes from the same files, so
that both backends agree on a model (docs/gguf.md, "How the HF tokenizer and llama.cpp agree"): which
tokens are control tokens, the bytes each token stands for (`llama_token_to_piece` with special=false: control
tokens print nothing), and which tokens end generation (llama-vocab.cpp `load`, which picks them by their
text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.hf_config import find_chat_template

# llama-vocab.cpp load(): tokens that end generation, by text (its EOT/EOM candidates are all in this list)
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})  # fmt: skip
# FIM pad / repo / file-separator tokens also end generation; the other FIM tokens only become control tokens
FIM_EOG_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})  # fmt: skip
FIM_TEXTS = frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
    "▁<MID>", "<|code_middle|>", "<|middle|>",
})  # fmt: skip
CONTROL_TEXTS = (
    EOG_TEXTS | FIM_EOG_TEXTS | FIM_TEXTS
)  # llama.cpp makes these control tokens whatever their type
ALWAYS_PRINTED = frozenset(
    {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}
)  # llama.cpp's gpt-oss hack
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py), the alphabet of byte-level BPE vocabs:
    printable bytes stand for themselves, the other 68 for U+0100 onwards, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_DECODER = _gpt2_byte_decoder()


def _byte_level_bytes(text: str) -> bytes:
    """llama.cpp's llama_decode_text: symbols back to bytes; an unknown symbol is spelled out, not dropped."""
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += f"[UNK_BYTE_0x{ch.encode().hex()}{text}]".encode()
    return bytes(out)


def _looks_special(text: str) -> bool:
    # convert_hf_to_gguf.py does_token_look_special: added tokens that some models forgot to mark special
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(
            f"{path} is not valid JSON ({e}); re-download it from the model's repository"
        ) from None
    return data if isinstance(data, dict) else {}


def _token_text(entry: Any) -> str | None:
    """tokenizer_config's `bos_token` etc.: a string or an AddedToken dict."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) and entry else None


def _ids(value: Any) -> list[int]:
    """config.json / generation_config.json `eos_token_id`: an int or a list of ints."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


@dataclass(frozen=True, eq=False)
class HFTokenizer:
    """Implements the tokenizer half of the ModelRunner protocol (tokenize, token_bytes, is_eog) for HF files."""

    tokenizer: Tokenizer  # parses special tokens in the text
    literal: Tokenizer  # the same, treating special-token text as plain text
    n_vocab: int  # ids 0..n_vocab-1 (the model's vocab_size may leave holes past the tokenizer's last id)
    pieces: tuple[bytes, ...]  # token id -> the bytes llama.cpp prints for it
    texts: tuple[str, ...]  # token id -> its vocabulary text ("" for a hole)
    eog: frozenset[int]
    bos_token_id: int  # -1 when the model has none
    eos_token_id: int
    add_bos: bool  # tokenize(add_special=True) starts with BOS
    add_eos: bool
    chat_template: str | None
    # control tokens: they print nothing, and text never tokenizes to them
    control: frozenset[int] = frozenset()

    @classmethod
    def from_dir(cls, directory: str | Path) -> HFTokenizer:
        """Load tokenizer.json, tokenizer_config.json, config.json and generation_config.json from `directory`.

        Raises:
            ModelFileError: tokenizer.json is missing or unreadable, or a config file is not valid JSON.
            UnsupportedFormatError: the tokenizer model is not BPE.
        """
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelFileError(
                f"{directory} has no tokenizer.json, which the torch backend needs; copy tokenizer.json and "
                "tokenizer_config.json from the model's original repository into this directory"
            )
        try:
            raw = path.read_text(encoding="utf-8")
            spec = json.loads(raw)
            tok, literal = Tokenizer.from_str(raw), Tokenizer.from_str(raw)
        except Exception as e:  # json's errors, or the bare Exceptions of the tokenizers library
            raise ModelFileError(
                f"{path} cannot be loaded ({e}); re-download it from the model's repository"
            ) from None
        literal.encode_special_tokens = True  # llama.cpp parse_special=false: "<|im_start|>" is just text
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise UnsupportedFormatError(
                f"{path}: a {model.get('type')} tokenizer; the torch backend reads BPE tokenizers (byte-level, or "
                "SentencePiece-style with byte fallback); serve this model with --backend llamacpp"
            )
        tc = _read_json(directory / "tokenizer_config.json")
        template = find_chat_template(directory)
        config = _read_json(directory / "config.json")
        gen = _read_json(directory / "generation_config.json")
        byte_level = "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])

        vocab = tok.get_vocab(with_added_tokens=True)
        vocab_size = config.get("vocab_size")
        n_vocab = max(max(vocab.values(), default=-1) + 1, vocab_size if isinstance(vocab_size, int) else 0)
        texts = [""] * n_vocab
        for text, i in vocab.items():
            texts[i] = text
        added = {a["id"]: a for a in spec.get("added_tokens") or [] if isinstance(a.get("id"), int)}

        bos = _special_id(tc.get("bos_token"), added, vocab, config.get("bos_token_id"))
        eos = _special_id(tc.get("eos_token"), added, vocab, config.get("eos_token_id"))
        post_bos, post_eos = _adds_special(spec.get("post_processor"), texts, bos, eos)
        # tokenizer_config's flags win; without any, llama.cpp's defaults (SentencePiece adds BOS, BPE does not)
        add_bos = _flag(tc.get("add_bos_token"), post_bos if post_bos is not None else not byte_level)
        add_eos = _flag(tc.get("add_eos_token"), bool(post_eos))
        control = {
            i
            for i, text in enumerate(texts)
            if text
            and text not in ALWAYS_PRINTED
            and (text in CONTROL_TEXTS or (i in added and (added[i].get("special") or _looks_special(text))))
        }
        # llama.cpp takes only the first FIM pad/repo/sep token it meets; a vocabulary rarely has two of a kind
        eog = {i for i, text in enumerate(texts) if text in EOG_TEXTS or text in FIM_EOG_TEXTS}
        eog |= {
            t for t in [eos, *_ids(config.get("eos_token_id")), *_ids(gen.get("eos_token_id"))] if t < n_vocab
        }
        eog.discard(-1)
        # llama-vocab.cpp's o200k_harmony / solar-open workaround: where the end-of-generation tokens include
        # <|return|> and <|call|> (or <|calls|> and <|flush|>), <|end|> only closes a message (gpt-oss's analysis
        # comes before its final answer): it leaves the list, and is printed like user-defined text
        eog_texts = {texts[i] for i in eog}
        harmony = ({"<|return|>"} <= eog_texts and eog_texts & {"<|call|>", "<|calls|>"}) or (
            eog_texts >= {"<|flush|>"} and eog_texts & {"<|call|>", "<|calls|>"})  # fmt: skip
        if harmony and "<|end|>" in eog_texts:
            end = next(i for i in eog if texts[i] == "<|end|>")
            eog.discard(end)
            control.discard(end)
        # llama.cpp parses its control tokens as specials even where tokenizer.json has them as plain vocabulary
        # (Qwen's "</s>") or as non-special added tokens (Phi-3's "</s>"); a byte-level vocabulary entry is
        # spelled like the raw text only when it is ASCII
        extra = [
            texts[i]
            for i in sorted(control)
            if not added.get(i, {}).get("special") and (i in added or not byte_level or texts[i].isascii())
        ]
        for t in (tok, literal):
            t.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in extra])
        pieces = _pieces(texts, set(added), control, model, byte_level)
        return cls(
            tok, literal, n_vocab, pieces, tuple(texts), frozenset(eog), bos, eos, add_bos, add_eos,
            template[0] if template else None, frozenset(control),
        )  # fmt: skip

    # ---- the ModelRunner side --------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of `text`. add_special: add BOS/EOS as the model's config says. parse_special: special
        tokens written in the text become their ids (otherwise they are tokenized as plain text)."""
        tok = self.tokenizer if parse_special else self.literal
        ids = tok.encode(text, add_special_tokens=False).ids
        if add_special:
            ids = ([self.bos_token_id] if self.add_bos and self.bos_token_id >= 0 else []) + ids
            ids += [self.eos_token_id] if self.add_eos and self.eos_token_id >= 0 else []
        return ids

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for, as llama.cpp prints it (control tokens: nothing, unless `special`)."""
        if special and token in self.control:
            return self.texts[token].encode()
        return self.pieces[token] if 0 <= token < self.n_vocab else b""

    def is_eog(self, token: int) -> bool:
        return token in self.eog

    def special_text(self, token: int) -> str:
        """A token's text, control tokens included (for a chat template's bos_token/eos_token)."""
        if not 0 <= token < self.n_vocab:
            return ""
        return self.pieces[token].decode("utf-8", "replace") or self.texts[token]

    @property
    def bos_token(self) -> str | None:
        return self.special_text(self.bos_token_id) or None

    @property
    def eos_token(self) -> str | None:
        return self.special_text(self.eos_token_id) or None


def _special_id(entry: Any, added: dict[int, dict], vocab: dict[str, int], config_id: Any) -> int:
    """gguf-py SpecialVocab's choice: tokenizer_config's token (an added token first), else config.json's id."""
    text = _token_text(entry)
    if text:
        found = next((i for i, a in added.items() if a.get("content") == text), vocab.get(text))
        if found is not None:
            return found
    return next(iter(_ids(config_id)), -1)


def _flag(value: Any, default: bool) -> bool:
    return value if isinstance(value, bool) else default


def _pieces(
    texts: list[str], added: set[int], control: set[int], model: dict[str, Any], byte_level: bool
) -> tuple[bytes, ...]:
    """Every token's bytes as llama.cpp's token_to_piece(special=false) gives them (llama-vocab.cpp)."""
    unk = model.get("unk_token")
    out = []
    for i, text in enumerate(texts):
        if not text or i in control or (not byte_level and text == unk):
            out.append(b"")  # a hole, a control token, or SentencePiece's <unk>: printed as nothing
        elif i in added:  # a user-defined token prints its text (convert_hf_to_gguf.py turns ▁ into spaces)
            out.append((text.replace("▁", " ") if byte_level else text).encode())
        elif byte_level:
            out.append(_byte_level_bytes(text))
        elif model.get("byte_fallback") and (m := _BYTE_PIECE.fullmatch(text)):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(text.replace("▁", " ").encode())  # llama_unescape_whitespace
    return tuple(out)


def _adds_special(post: Any, texts: list[str], bos: int, eos: int) -> tuple[bool | None, bool | None]:
    """Whether tokenizer.json's post-processor adds BOS first / EOS last (gguf-py SpecialVocab's crude parse of
    TemplateProcessing); None when it says nothing."""
    add_bos = add_eos = None
    procs = (post.get("processors") or [post]) if isinstance(post, dict) else []
    for proc in procs:
        if proc.get("type") == "RobertaProcessing":
            add_bos = add_eos = True
        single = (proc.get("single") or []) if proc.get("type") == "TemplateProcessing" else []
        if len(single) > 1:
            first, last = (single[j].get("SpecialToken", {}).get("id") for j in (0, -1))
            add_bos = bos >= 0 and first == texts[bos] if first else add_bos
            add_eos = eos >= 0 and last == texts[eos] if last else add_eos
    return add_bos, add_eos
