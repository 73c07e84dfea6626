"""A cross-encoder reranker served through llama.cpp's rank pooling, against transformers on the same weights.

The model is a tiny random RobertaForSequenceClassification (one relevance logit; the head of the bge-reranker
family: dense, tanh, out_proj on the first token) with SmolLM2's byte-level BPE vocabulary, converted to an F32
GGUF by llama.cpp's own convert_hf_to_gguf.py from the sdist that `make test` downloads. Why this model class:
- BertForSequenceClassification: the converter drops `pooler.dense`, which transformers' head applies, so
  llama.cpp computes a different function from the same checkpoint;
- XLMRobertaForSequenceClassification (bge-reranker itself) needs a SentencePiece model, and a WordPiece BERT
  vocabulary made here fails the converter's pre-tokenizer check (it knows only published vocabularies by hash).
SmolLM2's vocabulary passes that check ("smollm"). Its tokenizer.json gets RoBERTa's pair template
(<s> A </s></s> B </s>, with SmolLM2's <|im_start|> and <|im_end|> for <s> and </s>) and leaves a single text
alone, so the check still sees SmolLM2's tokens; the converter records add_bos/add_eos/add_sep from
tokenizer_config.json, and quantserve joins a pair from those flags as llama-server does.

The oracle is transformers: the tokenizer's own pair encoding, and the sigmoid of the model's logit.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_python, start_server

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Bananas are yellow when they are ripe.",
    "The Eiffel Tower stands in Paris.",
    "Berlin is the capital of Germany.",
    "France is a country in Western Europe, with Paris as its seat of government.",
    "Photosynthesis turns light into chemical energy.",
    "ok",
    "The Seine flows through Paris; the Loire is France's longest river.",
]
BOS, EOS = "<|im_start|>", "<|im_end|>"


def build_cross_encoder(
    dst: Path, tokenizer_from: Path, hidden: int = 64, layers: int = 2, positions: int = 128
) -> Path:
    """The tiny RobertaForSequenceClassification described above, saved as transformers saves it (bench/rerank.py
    builds a wider one)."""
    dst.mkdir(parents=True)
    tok = json.loads((tokenizer_from / "tokenizer.json").read_text())

    def special(t):
        return {"SpecialToken": {"id": t, "type_id": 0}}

    def text(s):
        return {"Sequence": {"id": s, "type_id": 0}}

    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [text("A")],
        "pair": [special(BOS), text("A"), special(EOS), special(EOS), text("B"), special(EOS)],
        "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in ((BOS, 1), (EOS, 2))},
    }
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "cls_token": BOS, "eos_token": EOS,
        "sep_token": EOS, "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_bos_token": True,
        "add_eos_token": True, "add_sep_token": True, "model_max_length": positions,
    }))  # fmt: skip
    config = transformers.RobertaConfig(
        vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=positions + 2, type_vocab_size=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        num_labels=1, layer_norm_eps=1e-5, hidden_act="gelu_pytorch_tanh",  # llama.cpp's BERT uses tanh GELU
        architectures=["RobertaForSequenceClassification"],
    )  # fmt: skip
    torch.manual_seed(1)  # a seed whose 8 documents score well apart (closest two: 0.0096)
    model = transformers.RobertaForSequenceClassification(config).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(dst)
    with torch.no_grad():  # weights large enough that the documents score apart, and logits centred on 0
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.05)
        model.classifier.out_proj.weight.mul_(20)
        logits = [model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0] for d in DOCUMENTS]
        model.classifier.out_proj.bias.sub_(torch.stack(logits).median())
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def cross_encoder(smollm2_hf, tmp_path_factory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("xenc") / "tiny-cross-encoder", smollm2_hf)


@pytest.fixture(scope="module")
def reranker_gguf(vendored, cross_encoder, tmp_path_factory) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on it (an empty `sentencepiece` stands in for the real one, which the
    converter imports before finding that there is no SentencePiece model)."""
    tmp = tmp_path_factory.mktemp("xenc-gguf")
    (tmp / "shim").mkdir()
    (tmp / "shim/sentencepiece.py").write_text("class SentencePieceProcessor: ...\n")
    out = tmp / "tiny-cross-encoder-f32.gguf"
    run_python([vendored / "convert_hf_to_gguf.py", cross_encoder, "--outfile", out, "--outtype", "f32"],
               tmp / "shim", tmp)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def oracle(cross_encoder):
    """transformers' relevance of each document: the sigmoid of the head's logit on the tokenizer's pair."""
    tok = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(cross_encoder).eval()

    def scores(query: str, documents: list[str]) -> list[float]:
        with torch.no_grad():
            logits = [model(**tok(query, d, return_tensors="pt")).logits[0, 0].item() for d in documents]
        return [1 / (1 + math.exp(-x)) for x in logits]

    return scores


@pytest.fixture(scope="module")
def reranker(reranker_gguf, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("xenc-server"), str(reranker_gguf), "--max-num-seqs", "4")
    yield srv
    assert srv.stop() == 0
    assert " 500 " not in srv.log() and "Traceback" not in srv.log(), srv.log()


def test_the_converter_wrote_a_rank_head(reranker_gguf):
    from quantserve.formats import read_gguf_info

    info = read_gguf_info(reranker_gguf)
    assert info.architecture == "bert" and info.get("tokenizer.ggml.pre") == "smollm"
    assert {"cls.weight", "cls.output.weight"} <= {t.name for t in info.tensors}
    assert info.rank_outputs == 1
    flags = [info.get(f"tokenizer.ggml.add_{k}_token") for k in ("bos", "eos", "sep")]
    assert flags == [True, True, True]


def test_pairs_are_joined_as_the_tokenizer_joins_them_and_batched(reranker_gguf, cross_encoder, monkeypatch):
    """The input of each pair equals transformers' pair encoding, and 8 documents take 2 decodes of 4."""
    import llama_cpp

    from quantserve.llm import load

    tok = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    llm = load(str(reranker_gguf), max_num_seqs=4, ctx_size=4096)
    try:
        assert llm.n_ctx == 129  # cut to its trained positions: past them llama.cpp would abort
        assert llm._runner.pair_inputs(QUERY, DOCUMENTS) == [tok(QUERY, d).input_ids for d in DOCUMENTS]
        decodes = []
        real = llama_cpp.llama_decode
        monkeypatch.setattr(
            llama_cpp, "llama_decode", lambda ctx, b: decodes.append(b.n_tokens) or real(ctx, b)
        )
        outputs, n_tokens = asyncio.run(llm.rank(QUERY, DOCUMENTS))
        assert len(decodes) == 2 and sum(decodes) == n_tokens == sum(
            len(tok(QUERY, d).input_ids) for d in DOCUMENTS
        )
        assert len(outputs) == len(DOCUMENTS) and all(len(o) == 1 for o in outputs)
    finally:
        llm.close()


def test_scores_and_order_equal_transformers(reranker, oracle):
    want = oracle(QUERY, DOCUMENTS)
    r = httpx.post(
        reranker.base_url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60
    )
    assert r.status_code == 200, r.text
    body = r.json()
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert [x["index"] for x in body["results"]] == sorted(range(len(want)), key=lambda i: -want[i])
    assert max(abs(got[i] - want[i]) for i in range(len(want))) < 1e-3, (got, want)
    assert max(want) - min(want) > 0.04  # the documents do score apart: the order is a real check
    assert body["results"][0]["document"] == {"text": DOCUMENTS[body["results"][0]["index"]]}
    # top_n, and /rerank answers the same
    r = httpx.post(reranker.base_url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3,
                                                       "return_documents": False}, timeout=60)  # fmt: skip
    assert [x["index"] for x in r.json()["results"]] == [x["index"] for x in body["results"][:3]]
    assert "document" not in r.json()["results"][0]


def test_it_is_listed_as_a_reranker_and_refuses_to_generate(reranker, reranker_gguf):
    base = reranker.base_url
    (card,) = httpx.get(base + "/v1/models").json()["data"]
    assert card["capabilities"] == ["rerank"]
    show = httpx.post(base + "/api/show", json={"model": card["id"]}).json()
    assert show["capabilities"] == ["rerank"]
    for path, body, param in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/v1/completions", {"prompt": "hi"}, "prompt"),
    ):
        r = httpx.post(base + path, json={"model": card["id"], **body}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "reranker" in err["message"] and "/v1/rerank" in err["message"] and err["param"] == param
    r = httpx.post(base + "/v1/embeddings", json={"model": card["id"], "input": "hi"}, timeout=30)
    assert r.status_code == 400, r.text
    r = httpx.post(base + "/v1/rerank", json={"query": QUERY, "documents": ["x" * 2000]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents[0]", r.text


def test_inspect_and_the_probe_know_it(reranker_gguf):
    from click.testing import CliRunner

    from quantserve.backends.llamacpp.probe import probe_gguf
    from quantserve.cli import main

    out = CliRunner().invoke(main, ["inspect", str(reranker_gguf)])
    assert out.exit_code == 0, out.output
    assert "cross-encoder: a classification head of 1 output(s)" in out.output
    assert probe_gguf(reranker_gguf) > 0  # the child ranks one pair and exits cleanly


def _info(tensors: dict[str, tuple[int, ...]], **metadata):
    from quantserve.formats.spec import GGUFInfo, GGUFTensorInfo

    table = tuple(GGUFTensorInfo(n, shape, 0, "F32", 0, 0) for n, shape in tensors.items())
    return GGUFInfo(Path("x.gguf"), 3, 0, 32, 0, {"general.architecture": "bert", **metadata}, table, "F32")


def test_which_heads_make_a_reranker():
    """Heads as llama.cpp's converter writes them (ne order: n_embd first)."""
    assert _info({"cls.weight": (64, 64), "cls.bias": (64,), "cls.output.weight": (64, 1)}).rank_outputs == 1
    assert _info({"cls.weight": (64, 1)}).rank_outputs == 1  # jina-reranker-v1-tiny: the projection alone
    assert _info({"cls.weight": (64, 64)}).rank_outputs == 0  # a dense layer before pooling: an embedder
    assert _info({"token_embd.weight": (64, 10)}).rank_outputs == 0
    labelled = {"cls.output.weight": (64, 2)}
    assert _info(labelled, **{"bert.classifier.output_labels": ["yes", "no"]}).rank_outputs == 2


def test_the_relevance_of_each_kind_of_head():
    """One logit: its sigmoid; yes/no labels (Qwen3-Reranker converted by llama.cpp, whose graph takes the
    softmax): P(yes) as given; two other classes: the softmax's second; more: not a reranker."""
    from types import SimpleNamespace

    from quantserve.rerank import classify, rerank_kind

    def relevance(outputs, labels=()):
        async def rank(query, documents):
            return [outputs], 3

        caps = ("rerank",) if len(outputs) <= 2 else ()  # as the plan lists it (backends/facts.capabilities)
        plan = SimpleNamespace(capabilities=caps)
        llm = SimpleNamespace(name="m", rank_outputs=len(outputs), rank_labels=labels, rank=rank, plan=plan)
        (score,), _ = asyncio.run(classify(llm, "q", ["d"]))
        return score, rerank_kind(llm)

    assert relevance([0.0]) == (0.5, "classifier")
    assert relevance([0.8, 0.2], ("yes", "no")) == (0.8, "classifier")
    score, _ = relevance([1.0, 3.0], ("LABEL_0", "LABEL_1"))
    assert abs(score - 1 / (1 + math.exp(-2.0))) < 1e-12
    with pytest.raises(Exception, match="3 classes"):
        relevance([0.1, 0.2, 0.3])
