"""Token ids a request sends itself (completions' `prompt`, embeddings' `input`, Ollama's `context`) are checked
against the vocabulary at the door: an id outside it is a 400 in the API's own shape that names the id and the
vocabulary's size, on both backends, and the server goes on serving. (Before, llama.cpp's failed decode came back as
a 500.) In-process app: the real SmolLM2 GGUF on llama.cpp, the random 2-layer llama with SmolLM2's tokenizer on
torch."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from quantserve.core.sampling_params import SamplingParams
from quantserve.errors import InvalidRequestError
from quantserve.llm import LLM, EngineSettings
from quantserve.registry import ModelEntry, ResolvedModel
from quantserve.server.app import create_app
from quantserve.server.settings import ServerSettings
from tests.conftest import THREADS

V = 49152  # SmolLM2's vocabulary: ids 0 to 49151


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def app(request, smollm2_gguf, tiny_llama_hf):
    source = smollm2_gguf if request.param == "llamacpp" else tiny_llama_hf
    entry = ModelEntry(source=str(source), backend=request.param)
    llm = LLM.load(
        ResolvedModel("m", source, entry), EngineSettings(threads=THREADS, max_num_seqs=2, ctx_size=512)
    )
    assert llm.n_vocab == V
    with TestClient(create_app(ServerSettings(), llm=llm)) as client:
        yield client, llm


def _says(message: str, bad: int) -> None:
    assert f"token id {bad}," in message and f"vocabulary of {V} tokens" in message, message


@pytest.mark.parametrize(
    ("prompt", "bad"), [([V], V), ([5, -1], -1), ([[1, 2], [3, V + 7]], V + 7), ([[1, 2], [-2]], -2)]
)
def test_completions_prompt_ids_outside_the_vocabulary_are_400(app, prompt, bad):
    client, _ = app
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="m", prompt=prompt, max_tokens=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt"
    _says(e.value.body["message"], bad)


def test_embeddings_input_ids_outside_the_vocabulary_are_400(app):
    client, _ = app
    for body, bad in (({"input": [V]}, V), ({"input": [[1, 2], [-3]]}, -3)):
        r = client.post("/v1/embeddings", json={"model": "m", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "input" and err["type"] == "invalid_request_error"
        _says(err["message"], bad)


def test_ollama_context_ids_outside_the_vocabulary_are_400(app):
    client, _ = app
    for context in ([1, V], [-5]):
        body = {
            "model": "m",
            "prompt": "hi",
            "context": context,
            "stream": False,
            "options": {"num_predict": 2},
        }
        r = client.post("/api/generate", json=body)
        assert r.status_code == 400, r.text
        assert set(r.json()) == {"error"}  # Ollama's shape
        _says(r.json()["error"], context[-1])


def test_the_library_refuses_them_too_and_the_server_still_answers(app):
    client, llm = app
    with pytest.raises(InvalidRequestError, match=f"token id {V},"):
        llm.generate([1, V], SamplingParams(max_tokens=2))
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
