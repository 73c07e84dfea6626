"""Ollama's native API end to end: real `quantserve run` processes on SmolLM2 driven by the official `ollama` client,
unchanged, on both backends (llama.cpp on the GGUF, torch on the HF checkpoint our GGUF -> HF converter makes), as
single-model servers and as one router serving both. Images through Ollama's API are in test_vision_server.py."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import numpy as np
import ollama
import pytest

from tests.conftest import PARIS, start_server

pytestmark = pytest.mark.slow

SAMPLING = "[models.{name}.sampling]\ntemperature = 0.2\ntop_p = 0.9\nrepeat_penalty = 1.1\n"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: the city's name
    """
    return "sunny, 18 degrees"


def models_toml(tmp, smollm2_gguf, smollm2_hf):
    """Both forms of SmolLM2 with the same sampling defaults (it needs its repeat penalty not to loop)."""
    toml = tmp / "models.toml"
    toml.write_text(
        f'[models.smollm2]\nsource = "{smollm2_gguf}"\nctx_size = 2048\n' + SAMPLING.format(name="smollm2")
        + f'[models.smollm2-hf]\nsource = "{smollm2_hf}"\nbackend = "torch"\nctx_size = 2048\n'
        + SAMPLING.format(name="smollm2-hf")
    )  # fmt: skip
    return toml


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def single(request, smollm2_gguf, smollm2_hf, tmp_path_factory):
    """A single-model server: the GGUF on llama.cpp, or the HF checkpoint on torch."""
    tmp = tmp_path_factory.mktemp(f"ollama-{request.param}")
    name = "smollm2" if request.param == "llamacpp" else "smollm2-hf"
    toml = models_toml(tmp, smollm2_gguf, smollm2_hf)
    srv = start_server(tmp, name, "--models-file", str(toml), "--max-num-seqs", "2")
    srv.model, srv.backend = name, request.param
    srv.client = ollama.Client(host=srv.base_url, timeout=300)
    yield srv
    assert srv.stop() == 0
    assert " 500 " not in srv.log() and "Traceback" not in srv.log(), srv.log()


def check_timings(r, n_prompt_min: int = 1) -> None:
    """The final object's durations are real: positive, and load + prompt + generation add up to the total."""
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert getattr(r, field) > 0, field
    parts = r.load_duration + r.prompt_eval_duration + r.eval_duration
    assert parts <= r.total_duration
    assert r.total_duration - parts < max(0.05 * r.total_duration, 5e6)  # the rest: building the reply
    assert r.prompt_eval_count >= n_prompt_min


def wait_status(base_url: str, model: str, status: str) -> dict:
    """/v1/models' card of `model` once it has that status (an unload finishes after the response)."""
    deadline = time.monotonic() + 30
    while True:
        card = next(m for m in httpx.get(base_url + "/v1/models").json()["data"] if m["id"] == model)
        if card.get("status") == status or time.monotonic() > deadline:
            assert card.get("status") == status, card
            return card
        time.sleep(0.1)


def test_list_show_ps(single):
    c = single.client
    listed = c.list().models
    assert [m.model for m in listed] == [f"{single.model}:latest"]
    details = listed[0].details
    assert details.family == "llama" and details.parameter_size == "134.5M"
    assert details.quantization_level == ("Q4_1" if single.backend == "llamacpp" else "F32")
    assert listed[0].size > 0
    shown = c.show(single.model)
    assert {"completion", "tools"} <= set(shown.capabilities)
    assert ("embedding" in shown.capabilities) and "vision" not in shown.capabilities
    assert "<|im_start|>" in shown.template  # SmolLM2's own chat template
    assert shown.modelinfo  # the GGUF's metadata or the HF config's keys
    running = c.ps().models
    assert [m.model for m in running] == [f"{single.model}:latest"]
    assert running[0].context_length == 2048 and running[0].expires_at.year > 2100  # never unloads
    assert running[0].size_vram == 0  # on the CPU


def test_chat_streamed_and_not(single):
    c = single.client
    r = c.chat(model=single.model, messages=PARIS, options={"temperature": 0, "num_predict": 24})
    assert "Paris" in r.message.content and r.done and r.done_reason == "stop"
    check_timings(r, n_prompt_min=20)
    parts = list(
        c.chat(model=single.model, messages=PARIS, stream=True, options={"temperature": 0, "num_predict": 24})
    )
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == r.eval_count
    assert "Paris" in "".join(p.message.content for p in parts)


def test_eval_count_is_the_tokens_produced(single):
    """num_predict ends the reply after exactly that many tokens: eval_count says so, streamed and not."""
    kw = dict(
        model=single.model, prompt="Write a long story about a dragon.", options={"num_predict": 9, "seed": 1}
    )
    r = single.client.generate(**kw)
    assert r.done_reason == "length" and r.eval_count == 9 and r.response
    check_timings(r)
    assert r.context and len(r.context) > r.prompt_eval_count  # the prompt's tokens and the reply's
    last = list(single.client.generate(**kw, stream=True))[-1]
    assert last.done and last.done_reason == "length" and last.eval_count == 9


def test_chat_with_a_tool_and_its_result(single):
    c = single.client
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    r = c.chat(model=single.model, messages=ask, tools=[get_weather], options={"temperature": 0})
    calls = r.message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)
    assert all(isinstance(call.function.arguments.get("city"), str) for call in calls)
    turns = [*ask, r.message, *({"role": "tool", "content": get_weather(**call.function.arguments),
                                "tool_name": "get_weather"} for call in calls)]  # fmt: skip
    after = c.chat(
        model=single.model, messages=turns, tools=[get_weather], options={"temperature": 0, "num_predict": 40}
    )
    assert after.done and (after.message.content or after.message.tool_calls)


def test_chat_format_json_schema(single):
    r = single.client.chat(
        model=single.model,
        messages=[{"role": "user", "content": "Name a city and its country, in JSON."}],
        format=CITY,
        options={"temperature": 0, "num_predict": 60},
    )
    jsonschema.validate(json.loads(r.message.content), CITY)
    r = single.client.generate(model=single.model, prompt="A JSON object about Paris:", format="json",
                               options={"temperature": 0, "num_predict": 60})  # fmt: skip
    assert isinstance(json.loads(r.response), dict)


def test_embed(single, smollm2_hf):
    """Unit vectors, one per input; the torch backend's equal transformers' mean-pooled last hidden state on the
    same weights, and llama.cpp's the OpenAI route's."""
    texts = ["The cat sat on the mat.", "Quantized models run locally."]
    r = single.client.embed(model=single.model, input=texts)
    got = np.array(r.embeddings)
    assert got.shape == (2, 576) and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    assert r.prompt_eval_count > 10
    if single.backend == "torch":
        import torch
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
        model = transformers.AutoModel.from_pretrained(smollm2_hf, torch_dtype=torch.float32)
        for text, vec in zip(texts, got, strict=True):
            with torch.no_grad():
                hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0].double().mean(0)
            want = (hidden / hidden.norm()).numpy()
            assert np.abs(vec - want).max() < 1e-4
    else:
        oai = httpx.post(
            single.base_url + "/v1/embeddings", json={"model": single.model, "input": texts}
        ).json()
        want = np.array([d["embedding"] for d in oai["data"]])
        assert np.abs(got - want).max() < 1e-6
    old = single.client.embeddings(model=single.model, prompt=texts[0]).embedding
    assert np.abs(np.array(old) - got[0]).max() < 1e-6


def test_errors_in_ollamas_shape(single):
    url = single.base_url + "/api/chat"
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": "nope", "messages": hi}, 404, "'nope' does not exist"),
        (
            {"model": single.model, "messages": hi, "options": {"temperature": "hot"}},
            400,
            "options.temperature",
        ),
        ({"model": single.model, "messages": hi, "keep_alive": "soon"}, 400, "keep_alive"),
        ({"model": single.model, "messages": "hi"}, 400, "messages"),
        ({"model": single.model, "messages": hi, "format": "yaml"}, 400, "format"),
    ]
    for body, status, says in cases:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == status and list(r.json()) == ["error"] and says in r.json()["error"], r.text
    with pytest.raises(ollama.ResponseError) as err:
        single.client.chat(model="nope", messages=hi)
    assert err.value.status_code == 404
    r = httpx.post(single.base_url + "/api/create", json={"model": "x"})
    assert r.status_code == 501 and "quantserve convert" in r.json()["error"]


def test_copy_and_delete_a_name(single):
    c = single.client
    c.copy(single.model, "mine")
    assert {m.model for m in c.list().models} == {f"{single.model}:latest", "mine:latest"}
    assert c.show("mine").details.family == "llama"
    c.delete("mine")
    assert [m.model for m in c.list().models] == [f"{single.model}:latest"]


def test_keep_alive_0_unloads_and_the_next_request_loads_again(single):
    """Last in this module: it unloads the model. /api/ps and /v1/models both say so."""
    c = single.client
    r = c.chat(model=single.model, messages=PARIS, keep_alive=0, options={"num_predict": 4})
    assert r.done
    card = wait_status(single.base_url, single.model, "unloaded")
    assert c.ps().models == [] and card["context_length"] == 2048
    assert httpx.get(single.base_url + "/ready").status_code == 200  # the server still serves
    again = c.chat(model=single.model, messages=PARIS, options={"temperature": 0, "num_predict": 24})
    assert "Paris" in again.message.content
    assert again.load_duration > 50e6  # it loaded again (the load took time)
    assert [m.model for m in c.ps().models] == [f"{single.model}:latest"]
    assert "unloaded (keep_alive=0)" in single.log()


# ---- router mode: both backends behind one server ---------------------------------------------------------


@pytest.fixture(scope="module")
def router(smollm2_gguf, smollm2_hf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ollama-router")
    toml = models_toml(tmp, smollm2_gguf, smollm2_hf)
    srv = start_server(tmp, "--models-file", str(toml), "--models", "all", "--max-num-seqs", "2")
    srv.client = ollama.Client(host=srv.base_url, timeout=300)
    yield srv
    assert srv.stop() == 0
    assert " 500 " not in srv.log() and "Traceback" not in srv.log(), srv.log()


def test_router_lists_loads_and_unloads_each_model(router):
    c = router.client
    assert {m.model for m in c.list().models} == {"smollm2:latest", "smollm2-hf:latest"}
    assert c.ps().models == []  # loaded on their first request
    assert "tools" in c.show("smollm2-hf").capabilities  # known before it loads
    for name in ("smollm2", "smollm2-hf"):
        r = c.chat(model=name, messages=PARIS, options={"temperature": 0, "num_predict": 24})
        assert "Paris" in r.message.content and r.load_duration > 50e6  # this request loaded it
        check_timings(r, n_prompt_min=20)
        assert c.embed(model=name, input="hello").embeddings
    assert {m.model for m in c.ps().models} == {"smollm2:latest", "smollm2-hf:latest"}
    c.generate(model="smollm2-hf", keep_alive=0)  # an empty prompt: unload only, as Ollama does
    wait_status(router.base_url, "smollm2-hf", "unloaded")
    assert [m.model for m in c.ps().models] == ["smollm2:latest"]
    status = {m["id"]: m["status"] for m in httpx.get(router.base_url + "/v1/models").json()["data"]}
    assert status == {"smollm2": "loaded", "smollm2-hf": "unloaded"}
    r = c.chat(model="smollm2", messages=PARIS, keep_alive="1h", options={"num_predict": 2})
    expires = c.ps().models[0].expires_at.timestamp() - time.time()
    assert 3500 < expires <= 3600
