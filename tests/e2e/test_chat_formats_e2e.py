"""Each 2026 family's chat format end to end with the official clients, on both backends: SmolLM2 served under ten
of llama.cpp's shipped templates at once (router mode, one models.toml entry per template), thinking on with a
budget of 8 tokens (`--reasoning on --reasoning-budget 8`: SmolLM2 never closes a block itself).

Rendering, the tool-call grammar and the reply parsers are the backends' shared code, so every family runs on
llama.cpp, and the torch backend (about 3x slower per token here) runs the four families that between them hold
every kind of marker its tokenizer and grammar must pass: control-token markers read with special tokens kept
(mistral), harmony's channel frames (gpt-oss), multi-byte Unicode markers (DeepSeek V3.1) and XML parameters
(Qwen3.5). The six others' torch runs were dropped to keep the suite within its time; their assertions are the
llama.cpp runs of the same tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import jsonschema
import openai
import pytest

from tests.conftest import ROOT, start_server, together

pytestmark = pytest.mark.slow

TEMPLATES = ROOT / "bench/.build/src/vendor/llama.cpp/models/templates"
# template -> (its tool-call format, whether it marks reasoning)
FAMILIES = {
    "Qwen-Qwen3-0.6B": ("hermes", True),
    "Qwen3.5-4B": ("qwen3-coder", True),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek-r1", True),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek-v3.1", True),
    "openai-gpt-oss-120b": ("harmony", True),
    "GLM-4.6": ("glm", True),
    "moonshotai-Kimi-K2": ("kimi-k2", False),
    "MiniMax-M2": ("minimax-m2", True),
    "google-gemma-4-31B-it": ("gemma4", True),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("mistral", True),
}
TORCH_FAMILIES = (
    "Qwen3.5-4B",
    "deepseek-ai-DeepSeek-V3.1",
    "openai-gpt-oss-120b",
    "mistralai-Ministral-3-14B-Reasoning-2512",
)
BACKENDS = {"llamacpp": tuple(FAMILIES), "torch": TORCH_FAMILIES}


def cases(thinking_only: bool = False) -> list:
    """(backend, family) pairs."""
    return [
        pytest.param(backend, name, id=f"{backend}-{name}")
        for backend, names in BACKENDS.items()
        for name in names
        if not thinking_only or FAMILIES[name][1]
    ]


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}
]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def clients(smollm2_gguf, smollm2_hf, tmp_path_factory) -> Iterator[Callable[[str], openai.OpenAI]]:
    """One router per backend for the whole module, started by its first test. (A module-scoped fixture
    parametrized per case would be set up again for every case: 33 server starts instead of two.)"""
    if not TEMPLATES.is_dir():
        pytest.skip(f"{TEMPLATES} not present (make test extracts llama.cpp's templates)")
    servers = {}

    def client(backend: str) -> openai.OpenAI:
        if backend not in servers:
            tmp = tmp_path_factory.mktemp(f"formats-{backend}")
            source = smollm2_gguf if backend == "llamacpp" else smollm2_hf
            entries = "".join(
                f'[models.{_model(name)}]\nsource = "{source}"\nbackend = "{backend}"\n'
                f'ctx_size = 2048\nchat_template = "{TEMPLATES / name}.jinja"\n'
                for name in BACKENDS[backend]
            )
            (tmp / "models.toml").write_text(entries)
            servers[backend] = start_server(
                tmp,
                "--models-file", str(tmp / "models.toml"), "--models-max", str(len(BACKENDS[backend])),
                "--reasoning", "on", "--reasoning-budget", "8", "--max-num-seqs", "2",  # each test's two requests
            )  # fmt: skip
        url = servers[backend].base_url + "/v1"
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

    yield client
    for srv in servers.values():
        assert srv.stop() == 0


def _model(name: str) -> str:
    return name.lower().replace(".", "-")


@pytest.mark.parametrize(("backend", "name"), cases())
def test_required_calls_whole_and_streamed(clients, backend, name):
    client = clients(backend)
    model = _model(name)
    card = next(m for m in client.models.list().data if m.id == model).model_dump()
    assert card["meta"]["tool_format"] == FAMILIES[name][0]
    # (DeepSeek's markers take SmolLM2 about 25 tokens each: a reply with its one call is about 100 tokens)
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=128)  # fmt: skip

    def streamed() -> dict[int, str]:
        args = {}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        return args

    r, args = together(lambda: client.chat.completions.create(**kw), streamed)
    (call,) = r.choices[0].message.tool_calls  # one call, and the grammar ends the reply after it
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert list(args) == [0] and jsonschema.validate(json.loads(args[0]), SCHEMA) is None


@pytest.mark.parametrize(("backend", "name"), cases(thinking_only=True))
def test_reasoning_apart_bounded_and_switched_off(clients, backend, name):
    client = clients(backend)
    model = _model(name)
    r, off = together(
        lambda: client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=32),
        lambda: client.chat.completions.create(
            model=model,
            messages=ASK,
            temperature=0,
            max_tokens=16,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        ),
    )
    message = r.choices[0].message.model_dump()
    assert message["reasoning_content"], message
    assert r.usage.completion_tokens_details.reasoning_tokens <= 8
    assert off.choices[0].message.model_dump().get("reasoning_content") is None


def _chat_calls(client, model: str, max_tokens: int, stream: bool) -> tuple[str, list[tuple[str, str]]]:
    kw = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=max_tokens
    )
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.finish_reason, [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
        ]
    calls: dict[int, list[str]] = {}
    reason = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    return reason, [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize(("backend", "name"), cases())
def test_a_reply_cut_in_its_calls_keeps_the_complete_ones(clients, backend, name):
    """SmolLM2 goes on writing calls under a parallel grammar until max_tokens cuts one (or it stops): the calls
    written in full come back parsed and valid, streamed and not, and an unfinished one is dropped. (The two runs,
    which decode in one batch, are compared call by call only for validity: batching may change a greedy reply.)"""
    client, model = clients(backend), _model(name)
    for reason, calls in together(
        *(lambda s=stream: _chat_calls(client, model, 72, s) for stream in (False, True))
    ):
        assert calls, "no complete call came back"
        for call_name, arguments in calls:
            assert call_name == "get_weather"
            jsonschema.validate(json.loads(arguments), SCHEMA)
        assert reason in ("length", "tool_calls")
