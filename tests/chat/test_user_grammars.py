"""The request's own grammars, as peers take them (llama-server's `grammar` and `json_schema`, vLLM's
`structured_outputs`), on chat completions and completions through the official client, and their 400s."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from quantserve.errors import InvalidRequestError
from quantserve.structured import user_grammar

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(oai, **extra) -> str:
    r = oai.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=24, temperature=0, extra_body=extra
    )
    return r.choices[0].message.content


def test_choice_regex_and_gbnf_on_chat(oai):
    assert _chat(oai, structured_outputs={"choice": ["Paris", "Lyon"]}) in ("Paris", "Lyon")
    assert re.fullmatch(
        r"[A-Z][a-z]+ [0-9]{2}", _chat(oai, structured_outputs={"regex": "[A-Z][a-z]+ [0-9]{2}"})
    )
    gbnf = 'root ::= "The answer is " city "."\ncity ::= "Paris" | "Rome"'
    assert _chat(oai, grammar=gbnf) in ("The answer is Paris.", "The answer is Rome.")


def test_json_schema_field_on_completions(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = oai.completions.create(
        model="smollm2",
        prompt="The capital of France as JSON:",
        max_tokens=32,
        temperature=0,
        extra_body={"json_schema": schema},
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    lark = oai.completions.create(
        model="smollm2",
        prompt="Yes or no?",
        max_tokens=4,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no"'}},
    )
    assert lark.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
        ({"json_schema": "not a schema"}, "json_schema"),
    ],
)
def test_bad_grammars_are_400s_naming_the_field(server, body, param):
    for path, extra in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(server.base_url + path, json={"model": "smollm2", "max_tokens": 4, **extra, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_a_grammar_with_tools_is_a_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": "smollm2", "messages": ASK, "tools": [tool], "grammar": 'root ::= "a"'},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"


def test_user_grammar_unit():
    assert user_grammar() is None
    assert user_grammar(structured={"choice": ["a b", 'say "hi"']}).source == 'start: "a b" | "say \\"hi\\""'
    with pytest.raises(InvalidRequestError) as e:
        user_grammar(structured="regex")
    assert e.value.param == "structured_outputs"
