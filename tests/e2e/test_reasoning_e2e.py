"""Reasoning end to end with the official clients: SmolLM2 served with DeepSeek-R1-distill's template (its
generation prompt opens `<think>`), on both backends. SmolLM2 never writes `</think>` itself, so the budget is what
ends its thinking: the engine writes the end marker, and the model answers after it. The library (LLM.reply, LLM.chat)
answers the same requests as the server does."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

import quantserve
from tests.conftest import ROOT, THREADS, start_server

pytestmark = pytest.mark.slow

R1 = (
    ROOT / "bench/.build/src/vendor/llama.cpp/models/templates/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def backend(request) -> str:
    if not R1.is_file():
        pytest.skip(f"{R1} not present (make test extracts llama.cpp's templates)")
    return request.param


@pytest.fixture(scope="module")
def base_url(backend, smollm2_hf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"reasoning-{backend}")
    args = ["--chat-template", str(R1), "--reasoning-budget", "8", "--max-num-seqs", "2"]
    if backend == "llamacpp":
        srv = start_server(tmp, "smollm2", *args)
    else:
        toml = tmp / "models.toml"
        toml.write_text(f'[models.smollm2-hf]\nsource = "{smollm2_hf}"\nbackend = "torch"\nctx_size = 1024\n')
        srv = start_server(tmp, "smollm2-hf", "--models-file", str(toml), *args)
    yield srv.base_url
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_the_plan_names_the_reasoning_format(base_url):
    card = httpx.get(base_url + "/v1/models").json()["data"][0]
    assert "reasoning" in card["capabilities"]
    assert card["meta"]["reasoning_format"].startswith("think (<think>…</think>, opened by the prompt")


def test_server_budget_bounds_the_reasoning_and_an_answer_follows(oai):
    r = oai.chat.completions.create(model=_model(oai), messages=ASK, max_tokens=24, temperature=0)
    message = r.choices[0].message.model_dump()
    assert message["reasoning_content"] and message["content"]
    assert "</think>" not in message["content"] and "<think>" not in message["reasoning_content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 8


def test_streamed_reasoning_matches_the_whole_reply(oai):
    model = _model(oai)
    whole = oai.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0)
    stream = oai.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0, stream=True)
    reasoning = content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta.model_dump()
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
    message = whole.choices[0].message.model_dump()
    assert (reasoning, content) == (message["reasoning_content"], message["content"])


def test_a_request_budget_and_thinking_off(oai):
    model = _model(oai)
    r = oai.chat.completions.create(
        model=model, messages=ASK, max_tokens=24, temperature=0, extra_body={"reasoning_budget": 3}
    )
    assert r.usage.completion_tokens_details.reasoning_tokens == 3
    assert r.choices[0].message.model_dump()["reasoning_content"]
    off = oai.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=16,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.model_dump().get("reasoning_content") is None
    assert off.usage.completion_tokens_details is None


def test_bad_reasoning_fields_are_400s_naming_them(base_url):
    model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
    for field, value in (("reasoning_budget", -1), ("reasoning_budget", "8"), ("reasoning_effort", "max")):
        r = httpx.post(
            base_url + "/v1/chat/completions", json={"model": model, "messages": ASK, field: value}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    r = httpx.post(
        base_url + "/v1/messages",
        json={
            "model": model,
            "max_tokens": 8,
            "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 0},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens" in r.json()["error"]["message"]


def test_anthropic_thinking_blocks(base_url):
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
    kw = dict(
        model=model,
        max_tokens=24,
        messages=ASK,
        extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 4},
    )
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content][:2] == ["thinking", "text"]
    assert m.content[0].thinking and m.content[0].signature
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in m.content]
    assert final.content[0].thinking == m.content[0].thinking
    # the thinking block goes back on the next turn, signature and all
    again = claude.messages.create(
        model=model,
        max_tokens=8,
        messages=[
            *ASK,
            {"role": "assistant", "content": m.content},
            {"role": "user", "content": "And Spain?"},
        ],
    )
    assert again.content


def test_responses_reasoning_items(oai):
    model = _model(oai)
    r = oai.responses.create(
        model=model, input="What is the capital of France?", max_output_tokens=24, temperature=0
    )
    assert [item.type for item in r.output][:2] == ["reasoning", "message"]
    assert r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == 8
    events = list(
        oai.responses.create(
            model=model,
            input="What is the capital of France?",
            max_output_tokens=24,
            temperature=0,
            stream=True,
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text


def test_a_model_without_reasoning_refuses_thinking(server):
    r = httpx.post(
        server.base_url + "/v1/messages",
        json={"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 4}},
    )
    assert r.status_code == 400 and "thinking" in r.json()["error"]["message"]


def test_a_user_grammar_applies_after_the_reasoning(oai):
    """vLLM's structured_outputs on a thinking model: the budgeted reasoning, then an answer the grammar holds."""
    r = oai.chat.completions.create(
        model=_model(oai),
        messages=ASK,
        max_tokens=24,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
    )
    message = r.choices[0].message.model_dump()
    assert message["reasoning_content"]
    assert message["content"] in ("Paris", "Lyon", "Nice")


def test_a_budget_of_zero_closes_the_block_at_once(oai):
    r = oai.chat.completions.create(
        model=_model(oai), messages=ASK, max_tokens=16, temperature=0, extra_body={"reasoning_budget": 0}
    )
    assert r.usage.completion_tokens_details is None or not r.usage.completion_tokens_details.reasoning_tokens
    assert not r.choices[0].message.model_dump().get("reasoning_content") and r.choices[0].message.content


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def library(backend, smollm2_hf):
    """The same model in this process, through the library, under the server's settings."""
    if backend == "llamacpp":  # as base_url serves it: models.toml's "smollm2", with its sampling defaults
        llm = quantserve.load(
            "smollm2",
            models_file=str(ROOT / "models.toml"),
            chat_template=str(R1),
            reasoning_budget=8,
            threads=THREADS,
        )
    else:
        llm = quantserve.load(
            str(smollm2_hf),
            backend="torch",
            chat_template=str(R1),
            reasoning_budget=8,
            ctx_size=1024,
            threads=THREADS,
        )
    yield llm
    llm.close()


@pytest.mark.parametrize(
    "ask",
    [
        # the tool-call grammar after thinking, ending the reply after its one call
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 128},
        {"reasoning_budget": 3, "max_tokens": 24},
    ],
    ids=["tool-call", "request-budget"],
)
def test_the_library_replies_as_the_server_does(oai, library, ask):
    """LLM.reply and /v1/chat/completions run one pipeline: the same request gives the same reasoning, answer and
    tool calls (greedy), with the server's budget or the request's, and the tool-call grammar."""
    served = oai.chat.completions.create(
        model=_model(oai),
        messages=ASK,
        temperature=0,
        **{k: v for k, v in ask.items() if k != "reasoning_budget"},
        extra_body={k: v for k, v in ask.items() if k == "reasoning_budget"},
    )
    message = served.choices[0].message.model_dump()
    reply = asyncio.run(library.reply(ASK, temperature=0, **ask))
    assert reply.reasoning == message["reasoning_content"] and reply.reasoning
    assert (reply.content or None) == (message["content"] or None)
    calls = [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]
    assert calls == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"] or []
    ]
    assert bool(calls) == ("tools" in ask)
    assert reply.finish_reason == served.choices[0].finish_reason
    # one streamed run is enough (a call's 100-odd tokens are slow on the torch backend)
    if "tools" not in ask:
        streamed = asyncio.run(_answer(library.chat(ASK, temperature=0, **ask)))
        assert streamed == reply.content  # chat streams the answer alone, without the reasoning


async def _answer(pieces) -> str:
    return "".join([p async for p in pieces])
