"""HFTokenizer agrees with llama.cpp on the same model: ids, every token's bytes, end-of-generation tokens.

SmolLM2's HF directory (made by our GGUF → HF converter) is compared with llama.cpp on the GGUF itself; llama.cpp's
own vocab-only test files (vendored sources under bench/.build, when present) add SentencePiece and other BPE
vocabularies. A tiny synthetic SentencePiece-style tokenizer checks byte fallback without any file.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats import read_gguf_info

lc = pytest.importorskip("llama_cpp")

VOCABS = Path(__file__).resolve().parents[3] / "bench/.build/src/vendor/llama.cpp/models"
TEXTS = [
    "Hello world",
    " Hello",
    "3.14159 12345678",
    "héllo wörld — naïve café",
    "héllo 🦙 привет 你好 😶\u200d🌫️",
    "  multiple   spaces\n\n\tx",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text <|im_end|> and <|endoftext|> inside",
    "",
]


def _llama(path: Path):
    return lc.Llama(str(path), vocab_only=True, verbose=False)


def _llama_pieces(llm) -> list[bytes]:
    vocab = lc.llama_model_get_vocab(llm.model)
    buf = ctypes.create_string_buffer(1024)
    out = []
    for i in range(lc.llama_vocab_n_tokens(vocab)):
        n = lc.llama_token_to_piece(vocab, i, buf, len(buf), 0, False)
        out.append(buf.raw[:n])
    return out


def _llama_eog(llm) -> set[int]:
    vocab = lc.llama_model_get_vocab(llm.model)
    return {i for i in range(lc.llama_vocab_n_tokens(vocab)) if lc.llama_vocab_is_eog(vocab, i)}


def _assert_tokenizes_like(tok: HFTokenizer, llm, texts: list[str]) -> None:
    for text in texts:
        for add in (False, True):
            for special in (False, True):
                ours = tok.tokenize(text, add_special=add, parse_special=special)
                assert ours == llm.tokenize(text.encode(), add_bos=add, special=special), (text, add, special)


# ---- SmolLM2 -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_hf, smollm2_gguf):
    return HFTokenizer.from_dir(smollm2_hf), _llama(smollm2_gguf)


def test_smollm2_tokenizes_like_llama_cpp(smol):
    tok, llm = smol
    _assert_tokenizes_like(tok, llm, TEXTS)


def test_smollm2_token_bytes_and_eog_match_llama_cpp_for_every_id(smol):
    tok, llm = smol
    pieces = _llama_pieces(llm)
    assert tok.n_vocab == len(pieces) == 49152
    assert [tok.token_bytes(i) for i in range(tok.n_vocab)] == pieces
    assert (
        set(tok.eog) == _llama_eog(llm) == {0, 2, 4}
    )  # <|endoftext|>, <|im_end|>, and <reponame> (a FIM token)
    assert not tok.is_eog(1) and tok.token_bytes(10**6) == b""


def test_smollm2_specials_and_chat_template(smol, smollm2_gguf):
    tok, llm = smol
    vocab = lc.llama_model_get_vocab(llm.model)
    assert (tok.bos_token_id, tok.eos_token_id) == (lc.llama_vocab_bos(vocab), lc.llama_vocab_eos(vocab))
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.add_bos == bool(lc.llama_vocab_get_add_bos(vocab)) and not tok.add_eos
    assert tok.chat_template == read_gguf_info(smollm2_gguf).metadata["tokenizer.chat_template"]


# ---- llama.cpp's vocab test files ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "qwen2", "llama-bpe"])
def test_vocab_files_match_llama_cpp(name, tmp_path):
    path = VOCABS / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not present (vendored llama.cpp sources are extracted under bench/.build)")
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    md = read_gguf_info(path).metadata
    tokenizer_from_gguf(md).save(tmp_path)
    tok, llm = HFTokenizer.from_dir(tmp_path), _llama(path)
    pieces = _llama_pieces(llm)
    assert [tok.token_bytes(i) for i in range(len(pieces))] == pieces
    assert set(tok.eog) == _llama_eog(llm)
    vocab = lc.llama_model_get_vocab(llm.model)
    assert tok.add_bos == bool(lc.llama_vocab_get_add_bos(vocab)) and tok.bos_token_id == lc.llama_vocab_bos(
        vocab
    )
    inp = Path(f"{path}.inp")
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inp.is_file() else []
    # llama.cpp strips the whitespace after Phi-3's special tokens, by model name (llama-vocab.cpp): not in the HF
    # files rebuilt from this GGUF, so those texts are left out there
    ours = TEXTS[:-3] if name == "phi-3" else TEXTS + ["a </s> b"]
    _assert_tokenizes_like(tok, llm, texts[:40] + ours + ["", "x</s>y", "x<|endoftext|>y<|im_end|>"])


# ---- synthetic SentencePiece-style tokenizer -------------------------------------------------------------


def _write_spm_dir(directory: Path, **config) -> None:
    """<unk> <s> </s>, 256 byte pieces, and pieces merging into "▁hello"; BOS added, two named chat templates."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "h", "e", "l", "o", "▁h", "▁he", "▁hel", "▁hell", "▁hello", "<|im_end|>"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken("<user>", special=False, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    tc = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    } | config
    (directory / "tokenizer_config.json").write_text(json.dumps(tc))
    (directory / "config.json").write_text(json.dumps({"vocab_size": 280, "eos_token_id": 2}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 269]}))


def test_sentencepiece_byte_fallback(tmp_path):
    _write_spm_dir(tmp_path)
    tok = HFTokenizer.from_dir(tmp_path)
    hello, im_end, user = 268, 269, 270
    assert tok.n_vocab == 280  # config.json's vocab_size: ids past the tokenizer's last are holes
    assert tok.add_bos and not tok.add_eos  # SentencePiece adds BOS unless told otherwise
    assert tok.tokenize("hello", add_special=True, parse_special=True) == [1, hello]
    assert tok.tokenize("hello é", add_special=False, parse_special=True) == [hello, 259, 3 + 0xC3, 3 + 0xA9]
    assert tok.token_bytes(3 + 0x41) == b"A" and tok.token_bytes(3 + 0xC3) == b"\xc3"
    assert tok.token_bytes(hello) == b" hello" and tok.token_bytes(259) == b" "
    assert [tok.token_bytes(t) for t in (0, 1, 2, im_end, 279)] == [b""] * 5  # unk, control, EOG text, hole
    assert tok.token_bytes(user) == b"<user>"  # a user-defined token prints its text
    assert b"".join(
        tok.token_bytes(t) for t in tok.tokenize("hello é", add_special=True, parse_special=True)
    ) == (" hello é".encode())
    assert tok.eog == {2, im_end} and tok.eos_token == "</s>" and tok.bos_token == "<s>"
    assert tok.chat_template == "D"
    # <|im_end|> is plain vocabulary here, but llama.cpp makes it a control token: parsed as one in text
    assert tok.tokenize("<|im_end|>", add_special=False, parse_special=True) == [im_end]
    assert im_end not in tok.tokenize("<|im_end|>", add_special=False, parse_special=False)


def test_config_flags_and_template_files(tmp_path):
    _write_spm_dir(tmp_path, add_bos_token=False, add_eos_token=True, chat_template=None)
    (tmp_path / "chat_template.jinja").write_text("J")
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.tokenize("hello", add_special=True, parse_special=True) == [268, 2]
    assert tok.chat_template == "J"


def test_missing_or_bad_files_raise_typed_errors(tmp_path):
    with pytest.raises(ModelFileError, match="no tokenizer.json.*copy tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    _write_spm_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer_config.json is not valid JSON"):
        HFTokenizer.from_dir(tmp_path)
    wordpiece = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(UnsupportedFormatError, match="WordPiece tokenizer.*--backend llamacpp"):
        HFTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("extra", "end_ends"),
    [
        (("<|return|>", "<|call|>"), False),
        (("<|calls|>", "<|flush|>"), False),
        (("<|return|>",), True),
        ((), True),
    ],
)
def test_end_closes_a_message_where_harmony_ends_with_return_and_call(extra, end_ends, tmp_path):
    """llama-vocab.cpp's o200k_harmony (and solar-open) workaround: with <|return|> and <|call|> among the
    end-of-generation tokens, gpt-oss's <|end|> only closes its analysis message; generation goes on to the final
    answer, and <|end|> is printed like text. Phi-3's <|end|> (no <|return|>) still ends generation."""
    _write_spm_dir(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|end|>", *extra)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 280 + 1 + len(extra), "eos_token_id": 2}))
    ours = HFTokenizer.from_dir(tmp_path)
    end = tok.token_to_id("<|end|>")
    assert ours.is_eog(end) == end_ends
    assert ours.token_bytes(end) == (b"" if end_ends else b"<|end|>")
    assert all(ours.is_eog(tok.token_to_id(t)) for t in extra)
