"""Tool calls, the Responses API and Anthropic's Messages API end to end: real `quantserve run` processes on
SmolLM2, driven by the official `openai` and `anthropic` clients, on both backends (llama.cpp on the GGUF, the torch
backend on the HF checkpoint our GGUF -> HF converter makes). SmolLM2's own template knows no tools, so it gets the
generic format; a run with Qwen 2.5's template (`--chat-template`) takes the native Hermes path on the same model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.conftest import PARIS, ROOT, start_server, together

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a time zone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
QWEN_TEMPLATE = ROOT / "bench/.build/src/vendor/llama.cpp/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def base_url(request, smollm2_hf, tmp_path_factory):
    """The models.toml entry `smollm2` (the GGUF), or an entry for the HF checkpoint on the torch backend with the
    same sampling defaults (SmolLM2 needs its repeat penalty not to loop)."""
    tmp = tmp_path_factory.mktemp(f"agent-{request.param}")
    if request.param == "llamacpp":
        srv = start_server(tmp, "smollm2", "--max-num-seqs", "2")
    else:
        toml = tmp / "models.toml"
        toml.write_text(
            f'[models.smollm2-hf]\nsource = "{smollm2_hf}"\nbackend = "torch"\nctx_size = 2048\n'
            "[models.smollm2-hf.sampling]\ntemperature = 0.2\ntop_p = 0.9\nrepeat_penalty = 1.1\n"
        )
        srv = start_server(tmp, "smollm2-hf", "--models-file", str(toml), "--max-num-seqs", "2")
    yield srv.base_url
    assert srv.stop() == 0


@dataclass
class Api:
    oai: openai.OpenAI
    claude: anthropic.Anthropic
    model: str  # the served model's id (its file or directory name)


@pytest.fixture(scope="module")
def api(base_url) -> Api:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    return Api(oai, claude, oai.models.list().data[0].id)


def assert_valid_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


# ---- chat completions --------------------------------------------------------------------------------


def test_required_tool_call_validates_against_its_schema(api):
    r = api.oai.chat.completions.create(
        model=api.model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        assert_valid_call(call.function.name, call.function.arguments)


def test_streamed_tool_call_deltas_build_valid_calls(api):
    """(Not compared with the same request unstreamed: a prefix-cache hit computes the prompt's last token in a
    batch of its own, and a near tie in this tiny model's later calls can then go the other way.)"""
    kw = dict(model=api.model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in api.oai.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content  # nothing of the JSON leaks into content
        for tc in delta.tool_calls or []:
            if tc.id is not None:  # the first delta of a call: id, type and name, once
                assert tc.index not in calls and tc.type == "function" and tc.function.name
                calls[tc.index] = {
                    "id": tc.id,
                    "name": tc.function.name,
                    "arguments": tc.function.arguments or "",
                }
            else:
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and sorted(calls) == list(range(len(calls)))
    for c in calls.values():
        assert_valid_call(c["name"], c["arguments"])


def test_a_reply_cut_inside_its_calls_keeps_the_complete_ones(api):
    """max_tokens ends the reply inside its second call (measured from the uncut reply): every API, streamed and
    not, returns the calls written in full, parsed and valid, and drops the unfinished one."""
    kw = dict(model=api.model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True,
              temperature=0)  # fmt: skip
    full = api.oai.chat.completions.create(**kw, max_tokens=200)
    assert len(full.choices[0].message.tool_calls or []) >= 2, full  # SmolLM2 writes two calls here
    cut = full.usage.completion_tokens - 4  # inside the last call: its closing takes more than 4 tokens

    def valid(calls: list[tuple[str, str]]) -> None:
        assert calls, "no complete call came back"
        for name, arguments in calls:
            assert_valid_call(name, arguments)

    # Each API's whole and streamed requests at once (the server decodes two sequences in one batch)
    def streamed() -> dict[int, list[str]]:
        calls: dict[int, list[str]] = {}
        for chunk in api.oai.chat.completions.create(**kw, max_tokens=cut, stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name_args = calls.setdefault(tc.index, [tc.function.name or "", ""])
                name_args[1] += tc.function.arguments or ""
        return calls

    r, streamed_calls = together(lambda: api.oai.chat.completions.create(**kw, max_tokens=cut), streamed)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    valid([(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []])
    valid([(n, a) for n, a in streamed_calls.values()])
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    akw = dict(model=api.model, max_tokens=cut, messages=ASK, tools=tools, tool_choice={"type": "any"},
               extra_body=GREEDY)  # fmt: skip

    def claude_streamed():
        with api.claude.messages.stream(**akw) as stream:
            return stream.get_final_message()

    m, final = together(lambda: api.claude.messages.create(**akw), claude_streamed)
    assert m.stop_reason == "max_tokens"
    valid([(b.name, json.dumps(b.input)) for b in m.content if b.type == "tool_use"])
    valid([(b.name, json.dumps(b.input)) for b in final.content if b.type == "tool_use"])
    rkw = dict(model=api.model, input=ASK, tools=[{"type": "function", **t["function"]} for t in TOOLS],
               tool_choice="required", temperature=0, max_output_tokens=cut)  # fmt: skip

    def responses_streamed():
        with api.oai.responses.stream(**rkw) as stream:  # it ends with response.incomplete, as OpenAI's does
            (final,) = [e.response for e in stream if e.type == "response.incomplete"]
        return final

    resp, final = together(lambda: api.oai.responses.create(**rkw), responses_streamed)
    valid([(o.name, o.arguments) for o in resp.output if o.type == "function_call"])
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    valid([(o.name, o.arguments) for o in final.output if o.type == "function_call"])


def test_named_function_and_none(api):
    r = api.oai.chat.completions.create(
        model=api.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    for c in calls:
        assert_valid_call("get_time", c.function.arguments)
    r = api.oai.chat.completions.create(
        model=api.model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_two_turn_exchange_ends_in_text(api):
    """The call, then its result sent back as a `tool` message: the answer is text that uses the result.
    (Under tool_choice auto this 135M model calls the tool again; the client asks for the answer with none.)"""
    first = api.oai.chat.completions.create(
        model=api.model,
        messages=ASK,
        tools=TOOLS[:1],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    ).choices[0]
    call = first.message.tool_calls[0]
    result = {
        "role": "tool",
        "tool_call_id": call.id,
        "content": json.dumps({"temperature_c": 18, "sky": "sunny"}),
    }
    history = [*ASK, first.message.model_dump(exclude_none=True), result]
    r = api.oai.chat.completions.create(
        model=api.model, messages=history, tools=TOOLS[:1], tool_choice="none", temperature=0, max_tokens=40
    )
    answer = r.choices[0].message
    # the tool's result reached the model: it quotes the temperature, or (llama.cpp on an AVX2-only CPU, whose
    # kernels round otherwise) the sky, neither of which the question holds
    assert answer.tool_calls is None and ("18" in answer.content or "sunny" in answer.content)


def test_content_parts_in_every_role(api):
    parts = lambda text: [{"type": "text", "text": text}]  # noqa: E731
    msgs = [
        {"role": "system", "content": parts("You are a helpful assistant.")},
        {"role": "user", "content": parts("What is the capital of France?")},
    ]
    r = api.oai.chat.completions.create(model=api.model, messages=msgs, temperature=0, max_tokens=16)
    assert "Paris" in r.choices[0].message.content


def test_json_schema_output_validates(api):
    """The structured-output test of the llama.cpp suite, on both backends."""
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
    r = api.oai.chat.completions.create(
        model=api.model,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        temperature=0,
        max_tokens=200,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = api.oai.chat.completions.create(
        model=api.model,
        messages=[
            {"role": "user", "content": 'Reply with a JSON object with the keys "city" and "country".'}
        ],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


# ---- the Responses API --------------------------------------------------------------------------------


def test_responses_plain_and_streamed(api):
    kw = dict(
        model=api.model, input="What is the capital of France?", instructions="You are a helpful assistant."
    )
    r = api.oai.responses.create(**kw, temperature=0, max_output_tokens=24)
    assert r.status in ("completed", "incomplete") and "Paris" in r.output_text
    assert r.usage.input_tokens > 5 and r.usage.output_tokens >= 1
    with api.oai.responses.stream(**kw, temperature=0, max_output_tokens=24) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_text.delta" in kinds
    assert "response.output_text.done" in kinds and kinds[-1] in ("response.completed", "response.incomplete")


def test_responses_function_call_and_previous_response(api):
    tools = [{"type": "function", **t["function"]} for t in TOOLS[:1]]
    r = api.oai.responses.create(
        model=api.model,
        input=ASK[0]["content"],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls
    for c in calls:
        assert_valid_call(c.name, c.arguments)
    with api.oai.responses.stream(
        model=api.model,
        input=ASK[0]["content"],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    ) as stream:
        kinds = {event.type for event in stream}
        streamed = [o for o in stream.get_final_response().output if o.type == "function_call"]
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= kinds
    assert streamed
    for c in streamed:
        assert_valid_call(c.name, c.arguments)
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "18 C and sunny"} for c in calls
    ]
    r2 = api.oai.responses.create(
        model=api.model,
        previous_response_id=r.id,
        input=outputs,
        tool_choice="none",
        temperature=0,
        max_output_tokens=30,
    )
    assert "18" in r2.output_text and r2.previous_response_id == r.id


# ---- Anthropic's Messages API ---------------------------------------------------------------------------

GREEDY = {"temperature": 0}  # this client no longer takes temperature as an argument; the API still does


def test_anthropic_plain_and_streamed(api):
    kw = dict(
        model=api.model,
        max_tokens=24,
        system="You are a helpful assistant.",
        messages=PARIS[1:],
        extra_body=GREEDY,
    )
    m = api.claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
    assert "Paris" in m.content[0].text and m.usage.input_tokens > 5
    with api.claude.messages.stream(**kw) as stream:
        assert stream.get_final_text() == m.content[0].text
    count = api.claude.messages.count_tokens(
        model=api.model, system="You are a helpful assistant.", messages=PARIS[1:]
    )
    assert count.input_tokens == m.usage.input_tokens


def test_anthropic_tool_use_plain_and_streamed(api):
    tools = [
        {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
    ]
    kw = dict(
        model=api.model,
        max_tokens=100,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    m = api.claude.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    for use in uses:
        jsonschema.validate(use.input, WEATHER_SCHEMA)
    with api.claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    for block in final.content:
        assert block.type == "tool_use"
        jsonschema.validate(block.input, WEATHER_SCHEMA)
    # the result sent back as a tool_result block; with tool_choice none the answer is text
    result = [{"type": "tool_result", "tool_use_id": u.id, "content": "18 C and sunny"} for u in uses]
    history = [*ASK, {"role": "assistant", "content": [u.model_dump(exclude_none=True) for u in uses]}]
    m2 = api.claude.messages.create(
        model=api.model,
        max_tokens=30,
        messages=[*history, {"role": "user", "content": result}],
        tools=tools,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert m2.content[0].type == "text" and "18" in m2.content[0].text


def test_anthropic_stop_sequence(api):
    m = api.claude.messages.create(
        model=api.model,
        max_tokens=40,
        messages=PARIS[1:],
        stop_sequences=["Paris"],
        extra_body=GREEDY,
        system="Be brief.",
    )
    assert (
        m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris" and "Paris" not in m.content[0].text
    )


# ---- a native tool-call format on a real model ---------------------------------------------------------


def test_hermes_template_takes_the_native_path(tmp_path):
    """With Qwen 2.5's template, the same model writes <tool_call> blocks that the Hermes parser reads."""
    if not QWEN_TEMPLATE.is_file():
        pytest.skip(f"{QWEN_TEMPLATE} not present (make test extracts llama.cpp's templates)")
    srv = start_server(tmp_path, "smollm2", "--chat-template", str(QWEN_TEMPLATE), "--max-num-seqs", "1")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
        ).choices[0]
        assert len(r.message.tool_calls) == 1
        assert r.finish_reason == "tool_calls"
        for call in r.message.tool_calls:
            assert_valid_call(call.function.name, call.function.arguments)
        card = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
        assert card["meta"]["tool_format"] == "hermes"
    finally:
        assert srv.stop() == 0
