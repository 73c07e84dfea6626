"""End to end: the real server process on the real SmolLM2 GGUF, driven by the official openai client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import PARIS


def test_models_lists_the_model_with_its_context_length(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    assert models[0].model_extra["context_length"] == 4096  # models.toml's ctx_size


def test_chat_greedy_answers_paris_with_usage(client):
    r = client.chat.completions.create(model="smollm2", messages=PARIS, temperature=0, max_tokens=32)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    full = client.chat.completions.create(model="smollm2", messages=PARIS, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=PARIS,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_ends_with_done(server):
    body = {"messages": PARIS, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_completions_stream_and_non_stream(client):
    r = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    parts = list(
        client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text


def test_same_seed_same_output(client):
    kw = dict(
        model="smollm2",
        messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        temperature=1.0,
        top_p=1.0,
        max_tokens=32,
    )
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should not all give the same sample"


def test_stop_sequence_cuts_the_output(client):
    prompt = "Count: 1, 2, 3, 4, 5,"
    free = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0).choices[0]
    assert " 8" in free.text, free.text  # the model does count on, so the stop below is meaningful
    stopped = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop=[" 8", "never-seen"]
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(" 8")]


def test_n_2_returns_two_choices(client):
    r = client.chat.completions.create(
        model="smollm2", messages=PARIS, n=2, max_tokens=16, seed=7, temperature=0.8
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content  # seeds differ per choice
    stream = list(
        client.chat.completions.create(
            model="smollm2", messages=PARIS, n=2, max_tokens=16, seed=7, temperature=0.8, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in r.choices}


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer"},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        temperature=0,
        max_tokens=200,
    )
    data = json.loads(r.choices[0].message.content)
    jsonschema.validate(data, schema)


def test_json_object_output_parses(client):
    prompt = 'Reply with a JSON object with the keys "city" and "country" for Paris.'
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "stop"  # the grammar let the model close the object
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_logprobs(client):
    r = client.chat.completions.create(
        model="smollm2", messages=PARIS, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy picks the most likely token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5


def test_embeddings(client):
    r = client.embeddings.create(model="smollm2", input=["Paris is in France.", "hello"])
    vecs = [d.embedding for d in r.data]
    assert len(vecs) == 2 and len(vecs[0]) == 576
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-4
    assert vecs[0] != vecs[1]


# ---- errors ------------------------------------------------------------------------------------


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


def test_prompt_over_context_is_400_context_length_exceeded(server):
    body = {"messages": [{"role": "user", "content": "hello " * 9000}], "max_tokens": 4}
    err = _error(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60), 400)
    assert err["code"] == "context_length_exceeded"
    assert "4096" in err["message"]


def test_prompt_plus_max_tokens_over_context_is_400(server):
    body = {"prompt": "hello " * 100, "max_tokens": 8190}
    err = _error(httpx.post(server.base_url + "/v1/completions", json=body, timeout=60), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=PARIS)
    assert exc.value.body["code"] == "model_not_found"


def test_malformed_json_is_400(server):
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=b'{"messages": [',
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert "JSON" in _error(r, 400)["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": PARIS, "temperature": 5}, "temperature"),
        ({"messages": PARIS, "max_tokens": 0}, "max_tokens"),
        ({"messages": PARIS, "n": 100}, "n"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": PARIS, "top_logprobs": 50}, "top_logprobs"),
        ({}, "messages"),
        ({"messages": PARIS, "response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_bad_field_is_400_naming_it(server, body, param):
    err = _error(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=10), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_body_over_limit_is_413(server):
    body = {"prompt": "x" * (2 * 1024 * 1024)}
    _error(httpx.post(server.base_url + "/v1/completions", json=body, timeout=30), 413)


def test_health_ready_metrics(server, client):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/ready").status_code == 200
    client.chat.completions.create(model="smollm2", messages=PARIS, max_tokens=2)
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "quantserve_requests_total",
        "quantserve_prompt_tokens_total",
        "quantserve_completion_tokens_total",
        "quantserve_time_to_first_token_seconds_bucket",
        "quantserve_request_latency_seconds_bucket",
        "quantserve_queue_depth",
    ):
        assert name in text
    assert 'quantserve_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'quantserve_completion_tokens_total{model="smollm2"}' in text  # per-model series
    assert 'quantserve_model_ready{model="smollm2"} 1.0' in text


def test_a_plain_request_with_the_default_sampling_ends_by_itself(client):
    """The first thing a user sends: no system prompt, no sampling fields. models.toml's defaults for the bundled
    model (with its repeat penalty) must let the reply end, not loop until the context is full."""
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 300, r.usage
