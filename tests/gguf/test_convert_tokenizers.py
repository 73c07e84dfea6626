"""Tokenizers rebuilt from GGUF metadata tokenize like llama.cpp, and convert back to the same GGUF vocab.

Uses llama.cpp's own vocab-only test files and their inputs (models/ggml-vocab-*.gguf[.inp]) from the
vendored llama.cpp sources under bench/.build when present; the SmolLM2 checks always run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest

from quantserve.converters.gguf.tokenizer import PRE_KEY, tokenizer_from_gguf
from quantserve.errors import UnsupportedFormatError
from quantserve.formats import read_gguf_info
from quantserve.gguf.pretokenizers import CHECK_TEXT, PRE_TOKENIZER_HASHES
from quantserve.gguf.tokenizer import vocab_from_hf

llama_cpp = pytest.importorskip("llama_cpp")

VOCABS = Path(__file__).resolve().parents[2] / "bench/.build/src/vendor/llama.cpp/models"
NAMES = ["llama-bpe", "qwen2", "gpt-2", "starcoder", "deepseek-llm", "deepseek-coder", "falcon", "refact",
         "command-r", "mpt", "qwen35", "llama-spm", "phi-3"]  # fmt: skip
EXTRA = ["Hello world", " Hello", "3.14159 12345678", "héllo 🦙 привет 你好", "  multiple   spaces\n\n\tx"]


def _vocab(name: str) -> Path:
    path = VOCABS / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not present (vendored llama.cpp sources are extracted under bench/.build)")
    return path


def _texts(path: Path) -> list[str]:
    inp = Path(f"{path}.inp")
    return (inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inp.is_file() else []) + EXTRA


def _llama(path: Path):
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def _write_vocab_gguf(path: Path, like: dict, vocab) -> None:
    """A vocab-only GGUF: the original's architecture keys plus our converted tokenizer keys."""
    arch = like["general.architecture"]
    w = gguf.GGUFWriter(path, arch=arch)
    for key, value in like.items():
        if key.startswith(f"{arch}."):
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    vocab.add_to(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", NAMES)
def test_rebuilt_tokenizer_matches_llama_cpp_and_converts_back(name, tmp_path):
    path = _vocab(name)
    md = read_gguf_info(path).metadata
    hf = tokenizer_from_gguf(md)
    llm = _llama(path)
    for text in _texts(path):
        assert hf.tokenizer.encode(text, add_special_tokens=False).ids == llm.tokenize(
            text.encode(), add_bos=False, special=True
        ), text
    hf.save(tmp_path)
    back = vocab_from_hf(tmp_path, {"vocab_size": len(md["tokenizer.ggml.tokens"])})
    assert back.model == md["tokenizer.ggml.model"] and back.pre == md["tokenizer.ggml.pre"]
    assert back.tokens == md["tokenizer.ggml.tokens"]
    # today's convert_hf_to_gguf.py types user-defined tokens that look special ("<|x|>", "<｜x｜>", "<pad>")
    # as CONTROL; some of these test files predate that rule
    looks_special = [
        t in ("<pad>",) or t[:2] in ("<|", "<｜") and t[-2:] in ("|>", "｜>") for t in back.tokens
    ]
    expected = [
        3 if ty == 4 and s else ty
        for ty, s in zip(md["tokenizer.ggml.token_type"], looks_special, strict=True)
    ]
    if (
        back.model == "llama"
    ):  # only the unk piece is UNKNOWN (phi-3's file also types <unk> CONTROL, pads UNKNOWN)
        unk = md["tokenizer.ggml.unknown_token_id"]
        expected = [2 if i == unk else 3 if ty == 2 else ty for i, ty in enumerate(expected)]
    assert back.token_types == expected
    assert back.special.merges == (md.get("tokenizer.ggml.merges") or [])
    ids = {k: md.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    assert {k: back.special.special_token_ids.get(k[:3] if k != "unknown" else "unk") for k in ids} == ids
    if back.model == "llama":  # our SentencePiece scores are merge ranks: check llama.cpp tokenizes the same
        _write_vocab_gguf(tmp_path / "back.gguf", md, back)
        again = _llama(tmp_path / "back.gguf")
        for text in _texts(path):
            assert again.tokenize(text.encode(), special=True) == llm.tokenize(text.encode(), special=True), (
                text
            )


def test_a_sentencepiece_vocab_is_padded_to_the_embeddings_rows(tmp_path):
    """llama.cpp needs a token per embedding row: a SentencePiece-style tokenizer.json with fewer pieces than
    config.json's vocab_size (Gemma 3's 262208 rows) gets unused [PADi] tokens, as _create_vocab_sentencepiece
    pads its list."""
    path = _vocab("llama-spm")
    md = read_gguf_info(path).metadata
    tokenizer_from_gguf(md).save(tmp_path)
    n = len(md["tokenizer.ggml.tokens"])
    back = vocab_from_hf(tmp_path, {"vocab_size": n + 3})
    assert back.tokens[:n] == md["tokenizer.ggml.tokens"] and back.tokens[n:] == [
        f"[PAD{n + i}]" for i in range(3)
    ]
    assert back.token_types[n:] == [5, 5, 5] and len(back.scores) == n + 3


def test_pre_tokenizer_found_by_hash(smollm2_gguf, tmp_path):
    md = read_gguf_info(smollm2_gguf).metadata
    hf = tokenizer_from_gguf(md)
    ids = hf.tokenizer.encode(CHECK_TEXT).ids
    assert PRE_TOKENIZER_HASHES[hashlib.sha256(str(ids).encode()).hexdigest()] == "smollm"
    del hf.tokenizer_config[PRE_KEY]  # as if the HF directory came from the hub, not from us
    hf.save(tmp_path)
    assert vocab_from_hf(tmp_path, {"vocab_size": 49152}).pre == "smollm"


def test_unknown_pre_tokenizer_says_how_to_fix(smollm2_gguf, tmp_path):
    hf = tokenizer_from_gguf({**read_gguf_info(smollm2_gguf).metadata, "tokenizer.ggml.pre": "gpt-2"})
    del hf.tokenizer_config[PRE_KEY]
    hf.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer.json").read_text())  # a pre-tokenizer no llama.cpp name has
    split_e = {"type": "Split", "pattern": {"String": "e"}, "behavior": "Isolated", "invert": False}
    config["pre_tokenizer"]["pretokenizers"].insert(0, split_e)
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedFormatError, match=f'add "{PRE_KEY}": "<name>" to tokenizer_config.json'):
        vocab_from_hf(tmp_path, {"vocab_size": 49152})


def test_unsupported_gguf_tokenizer_model():
    with pytest.raises(UnsupportedFormatError, match="'bert'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
