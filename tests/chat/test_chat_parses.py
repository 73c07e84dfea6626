"""llama.cpp's own expected parses of each family's tool calls (tests/test-chat.cpp in the llama-cpp-python sdist,
carried over as data in tests/data/llamacpp_tool_cases.json): the raw model output, fed one character at a time
through the template's reasoning splitter and tool-call parser, gives llama.cpp's content, reasoning_content and
tool calls (names, ids where llama.cpp sets them, and arguments compared as JSON, key order included)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from quantserve.chat import ChatTemplate, Tool, tool_format
from quantserve.chat.reasoning import PROBE_ANSWER, ReasoningSplitter
from quantserve.chat.reply import ReplyAssembler
from quantserve.chat.tools import CallChecker

TEMPLATES = Path(__file__).resolve().parents[2] / "bench/.build/src/vendor/llama.cpp/models/templates"
DATA = json.loads((Path(__file__).resolve().parents[1] / "data/llamacpp_tool_cases.json").read_text())
CASES = [
    c
    for c in DATA["cases"]
    if not c["is_partial"] and c["other_settings"] in ("", ".expect_reconstruction()")
]

DIVERGES = {
    2377: "Qwen3.5: llama.cpp keeps a doubled '<think>' of a block the prompt already opened as reasoning text",
    6219: "Apriel 1.6: llama.cpp keeps the prompt's 'Here are my reasoning steps:' in the reasoning",
}


def _template(name: str) -> ChatTemplate:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} not present (make test extracts llama.cpp's templates under bench/.build)")
    return ChatTemplate.from_file(path, bos_token="<s>", eos_token="</s>")


def _end_of_turn(t: ChatTemplate) -> str | None:
    """The marker the template writes after an answer: the engine stops there, llama.cpp's inputs keep it."""
    user = {"role": "user", "content": "q"}
    full = t.render([user, {"role": "assistant", "content": PROBE_ANSWER}], add_generation_prompt=False)
    m = re.match(r"<[^<>]+>|\[[^\[\]]+\]", full[full.find(PROBE_ANSWER) + len(PROBE_ANSWER) :].strip())
    return m.group(0) if m else None


@pytest.mark.parametrize("case", CASES, ids=[f"{c['template'][:-6]}:{c['line']}" for c in CASES])
def test_llamacpp_expected_tool_call_parse(case):
    if case["line"] in DIVERGES:
        pytest.skip(DIVERGES[case["line"]])
    t = _template(case["template"])
    fmt = tool_format(t)
    if not fmt.native:
        pytest.skip(f"{case['template']}: its family's tool-call format is not native here yet (generic)")
    tools = []
    for name in case["tools"]:
        fn = DATA["tools"][name]["function"]
        tools.append(Tool(fn["name"], fn.get("description"), fn.get("parameters") or {"type": "object"}))
    reasoning = t.reasoning
    splitter = None
    if reasoning is not None and case["reasoning_format"] not in (None, "none"):
        thinking = case["enable_thinking"] is not False
        prompt = t.render([{"role": "user", "content": "Hey there!"}], enable_thinking=thinking)
        splitter = ReasoningSplitter(reasoning, reasoning.opened_in(prompt), fmt.markers)
    text = case["input"]
    eot = _end_of_turn(t)
    if eot and text.rstrip().endswith(eot):
        text = text.rstrip().removesuffix(eot)
    asm = ReplyAssembler(fmt.reply_parser(tuple(tools)), CallChecker(tuple(tools)), True, splitter)
    for ch in text:
        asm.feed(ch)
    _, reply = asm.finish("stop")
    assert (reply.content or "").strip() == case["expect_content"].strip()
    assert (reply.reasoning or "").strip() == case["expect_reasoning"].strip()
    got = [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]
    want = [(c["name"], json.loads(c["arguments"])) for c in case["expect_tool_calls"]]
    assert [(n, list(a.items())) for n, a in got] == [(n, list(a.items())) for n, a in want]
    for call, expected in zip(reply.tool_calls, case["expect_tool_calls"], strict=True):
        if expected["id"]:
            assert call.id == expected["id"]
