"""Bad input to the tool, Responses and Anthropic routes gets a 400 (or 401/404/413) in the route's own error shape,
naming the field, and the server keeps serving. In-process app on the real SmolLM2 GGUF."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from quantserve.llm import LLM, EngineSettings
from quantserve.registry import ModelEntry, ResolvedModel
from quantserve.server.app import create_app
from quantserve.server.settings import ServerSettings
from tests.conftest import PARIS, THREADS

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def app_client(smollm2_gguf, **settings) -> TestClient:
    resolved = ResolvedModel("smollm2", smollm2_gguf, ModelEntry(source=str(smollm2_gguf)))
    llm = LLM.load(resolved, EngineSettings(threads=THREADS, max_num_seqs=2))
    return TestClient(create_app(ServerSettings(**settings), llm=llm))


@pytest.fixture(scope="module")
def client(smollm2_gguf):
    with app_client(smollm2_gguf, responses_store_size=1) as c:
        yield c


def openai_error(r, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def anthropic_error(r, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


CHAT_CASES = [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters", "JSON schema"),
    ({"tools": [TOOL, TOOL]}, "tools[1]", "repeats"),
    ({"messages": [PARIS[1], {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
     "messages[0].content[1]", "text only"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {}}]}]},
     "messages[0].tool_calls[0].function.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}},
     "response_format", None),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "says"), CHAT_CASES)
def test_bad_chat_fields_are_400_naming_the_field(client, extra, param, says):
    body = {"messages": PARIS, "max_tokens": 4, **extra}
    message = openai_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert says is None or says in message


RESPONSES_CASES = [
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_image"}]}]},
     "input[0].content[1]"),
    ({"input": [{"type": "function_call_output", "output": "18 C"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": True}]}, "input[0].output"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), RESPONSES_CASES)
def test_bad_responses_fields_are_400_naming_the_field(client, body, param):
    openai_error(client.post("/v1/responses", json={"max_output_tokens": 4, **body}), 400, param)


def test_responses_store_says_when_a_response_was_evicted(client):
    first = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()
    assert client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 2})  # the store keeps one
    r = client.post("/v1/responses", json={"input": "Again", "previous_response_id": first["id"]})
    assert "no longer stored" in openai_error(r, 400, "previous_response_id")
    assert r.json()["error"]["code"] == "previous_response_not_found"
    openai_error(client.get(f"/v1/responses/{first['id']}"), 404)
    unstored = client.post(
        "/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "store": False}
    ).json()
    openai_error(client.get(f"/v1/responses/{unstored['id']}"), 404)


ANTHROPIC_CASES = [
    ({"messages": [PARIS[1]]}, "max_tokens"),  # required, as Anthropic's API has it
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 4, "messages": [PARIS[1]], "tools": [{"name": "f"}]}, "input_schema"),
    ({"max_tokens": 4, "messages": [PARIS[1]], "tools": [{"type": "bash_20250124", "name": "bash"}]}, "client tools"),
    ({"max_tokens": 4, "messages": [PARIS[1]], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"max_tokens": 4, "messages": [PARIS[1]], "tool_choice": {"type": "tool", "name": "f"}}, "no tools"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 4, "messages": [PARIS[1]], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                     "content": 5}]}]}, "content[0].content"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "says"), ANTHROPIC_CASES)
def test_bad_anthropic_requests_are_400_in_anthropic_shape(client, body, says):
    message = anthropic_error(client.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert says in message


def test_anthropic_route_errors_keep_anthropic_shape(client):
    body = {"model": "nope", "max_tokens": 4, "messages": [PARIS[1]]}
    assert "nope" in anthropic_error(client.post("/v1/messages", json=body), 404, "not_found_error")
    r = client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert "not valid JSON" in anthropic_error(r, 400, "invalid_request_error")
    r = client.post("/v1/messages/count_tokens", json={"messages": []})
    anthropic_error(r, 400, "invalid_request_error")


def test_a_call_cut_off_by_max_tokens_comes_back_as_text(client):
    body = {"messages": PARIS, "tools": [TOOL], "tool_choice": "required", "max_tokens": 5, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith('{"tool_call')  # the generic format's JSON, as written
    assert r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("max_tokens", [5, 1])
def test_a_message_cut_inside_its_only_tool_call_is_never_empty(client, max_tokens):
    """/v1/messages cut by max_tokens inside its only tool_use (5 tokens), or before anything (1): at least one
    content block, whole and streamed (clients read content[0]), holding the text as written."""
    tool = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}
    body = {"messages": [PARIS[1]], "tools": [tool], "tool_choice": {"type": "any"}, "max_tokens": max_tokens}
    r = client.post("/v1/messages", json={**body, "temperature": 0})
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["stop_reason"] == "max_tokens" and whole["content"], whole
    assert [b["type"] for b in whole["content"]] == ["text"]
    with client.stream("POST", "/v1/messages", json={**body, "temperature": 0, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert [b["type"] for b in starts] == ["text"] and text == whole["content"][0]["text"]
    if max_tokens == 5:
        assert whole["content"][0]["text"].startswith('{"tool_call')  # the generic format's JSON, as written


def test_developer_messages_are_system_messages_for_templates_without_that_role(client):
    counts = [
        client.post("/v1/messages/count_tokens", json={"messages": [PARIS[1]], "system": "Be brief."}).json(),
        client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "developer", "content": "Be brief."}, PARIS[1]], "max_tokens": 1},
        ).json()["usage"],
    ]
    assert counts[0]["input_tokens"] == counts[1]["prompt_tokens"]


def test_anthropic_prefill_is_continued(client):
    """A final assistant message is a prefill: the reply continues it and does not repeat it."""
    body = {
        "max_tokens": 8,
        "temperature": 0,
        "system": "You are a helpful assistant.",
        "messages": [PARIS[1], {"role": "assistant", "content": "The capital of France is"}],
    }
    text = client.post("/v1/messages", json=body).json()["content"][0]["text"]
    assert "Paris" in text and not text.startswith("The capital")


def test_after_all_that_the_server_still_answers(client):
    r = client.post("/v1/chat/completions", json={"messages": PARIS, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_api_key_by_bearer_or_x_api_key_with_errors_in_each_shape(smollm2_gguf):
    with app_client(smollm2_gguf, api_key="secret", max_body_bytes=4096) as c:
        chat = {"messages": PARIS, "max_tokens": 2}
        msg = {"max_tokens": 2, "messages": [PARIS[1]]}
        assert (
            c.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer secret"}).status_code
            == 200
        )
        assert c.post("/v1/messages", json=msg, headers={"x-api-key": "secret"}).status_code == 200
        assert (
            c.post(
                "/v1/responses", json={"input": "hi", "max_output_tokens": 2}, headers={"x-api-key": "secret"}
            ).status_code
            == 200
        )
        openai_error(c.post("/v1/chat/completions", json=chat), 401)
        anthropic_error(
            c.post("/v1/messages", json=msg, headers={"x-api-key": "wrong"}), 401, "authentication_error"
        )
        big = {**msg, "system": "x" * 8000}
        r = c.post("/v1/messages", json=big, headers={"x-api-key": "secret"})
        anthropic_error(r, 413, "request_too_large")
        # Ollama's routes: the same key, Ollama's shape
        ollama_chat = {
            "model": "smollm2",
            "messages": [PARIS[1]],
            "stream": False,
            "options": {"num_predict": 2},
        }
        r = c.post("/api/chat", json=ollama_chat, headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200 and r.json()["done"]
        # as Ollama's docs send it (`curl -d`: form-encoded), read as JSON as Ollama reads it
        form = {"Authorization": "Bearer secret", "content-type": "application/x-www-form-urlencoded"}
        r = c.post("/api/chat", content=json.dumps(ollama_chat), headers=form)
        assert r.status_code == 200 and r.json()["done"]
        for path in ("/api/tags", "/api/ps"):
            r = c.get(path)
            assert r.status_code == 401 and list(r.json()) == ["error"]
        r = c.post("/api/chat", json={**ollama_chat, "x": "y" * 8000}, headers={"x-api-key": "secret"})
        assert r.status_code == 413 and list(r.json()) == ["error"]
