"""/v1/rerank with a chat model as a yes/no judge, against transformers: SmolLM2's HF form on the torch backend,
and the F32 GGUF our converter makes of the same weights on llama.cpp (F32, so that llama.cpp computes with the
weights transformers has: on the Q4_1 file its quantized dot products move P(yes) by up to 0.03 here). The oracle
renders the same prompt with transformers' own chat template and tokenizer and takes the softmax over the "yes"
and "no" logits of the last position."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import start_server

pytestmark = pytest.mark.slow

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Bananas are yellow when they are ripe.",
    "The Eiffel Tower stands in Paris.",
    "Berlin is the capital of Germany.",
    "France is a country in Western Europe.",
    "Photosynthesis turns light into chemical energy.",
]
SYSTEM = (  # Qwen3-Reranker's (its model card), which quantserve.rerank uses
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def oracle(smollm2_hf):
    """transformers' P(yes) over yes + no for each document, on SmolLM2's HF weights."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)
    (yes,), (no,) = tok.encode("yes", add_special_tokens=False), tok.encode("no", add_special_tokens=False)

    def scores(query: str, documents: list[str], instruction: str = INSTRUCTION) -> list[float]:
        out = []
        for doc in documents:
            user = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            with torch.no_grad():
                logits = model(**tok(text, return_tensors="pt")).logits[0, -1]
            out.append(torch.softmax(logits[[yes, no]].double(), 0)[0].item())
        return out

    return scores


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def judge_server(request, smollm2_hf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"rerank-{request.param}")
    if request.param == "llamacpp":
        from quantserve.gguf.hf_to_gguf import hf_to_gguf

        model = tmp / "smollm2-f32.gguf"
        hf_to_gguf(smollm2_hf, model, "f32")
    else:
        model = smollm2_hf
    srv = start_server(
        tmp, str(model), "--backend", request.param, "--ctx-size", "2048", "--max-num-seqs", "4"
    )
    yield srv
    assert srv.stop() == 0
    assert " 500 " not in srv.log() and "Traceback" not in srv.log(), srv.log()


def rerank(srv, **body) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/rerank", json=body, timeout=120)


def test_yes_no_scores_equal_transformers(judge_server, oracle):
    want = oracle(QUERY, DOCUMENTS)
    r = rerank(judge_server, query=QUERY, documents=DOCUMENTS)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCUMENTS)))
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-3, (x, want)
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert r.json()["usage"]["prompt_tokens"] > 60 * len(DOCUMENTS)


def test_top_n_documents_as_objects_and_an_instruction(judge_server, oracle):
    instruction = "Given a question, find passages about the same country"
    want = oracle(QUERY, DOCUMENTS[:4], instruction)
    docs = [{"text": d} for d in DOCUMENTS[:4]]
    r = rerank(
        judge_server, query=QUERY, documents=docs, top_n=2, return_documents=False, instruction=instruction
    )
    results = r.json()["results"]
    best = sorted(range(4), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in results] == best and all("document" not in x for x in results)
    assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-3 for x in results)
    assert httpx.post(
        judge_server.base_url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS[:1]}
    ).is_success


def test_the_capability_is_listed(judge_server):
    card = httpx.get(judge_server.base_url + "/v1/models").json()["data"][0]
    assert "rerank" in card["capabilities"]
    shown = httpx.post(judge_server.base_url + "/api/show", json={"model": card["id"]}).json()
    assert "rerank" in shown["capabilities"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", ""]}, "documents[1]"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "q", "documents": "a"}, "documents"),
        ({"query": "q", "documents": ["a " * 3000]}, "documents[0]"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(judge_server, body, param):
    r = rerank(judge_server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
