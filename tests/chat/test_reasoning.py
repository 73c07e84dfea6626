"""Reasoning against llama.cpp's shipped chat templates (models/templates in the llama-cpp-python sdist, which
`make test` extracts): every template's reasoning format read from probe renders, and the parses of llama.cpp's own
test cases (tests/test-chat.cpp, carried over as data in tests/data/llamacpp_reasoning_cases.json) reproduced by the
splitter, fed one character at a time as a stream is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import pytest

from quantserve.chat import ChatRequest, ChatTemplate, build_prompt, tool_format
from quantserve.chat.reasoning import PROBE_ANSWER, ReasoningSplitter
from quantserve.chat.reasoning_request import ReasoningRequest
from quantserve.chat.reply import ReplyAssembler
from quantserve.chat.tools import CallChecker
from quantserve.core.thinking import ThinkingSpec, ThinkState
from quantserve.errors import InvalidRequestError
from quantserve.structured import json_schema_grammar

TEMPLATES = Path(__file__).resolve().parents[2] / "bench/.build/src/vendor/llama.cpp/models/templates"
CASES = json.loads((Path(__file__).resolve().parents[1] / "data/llamacpp_reasoning_cases.json").read_text())[
    "cases"
]

# One row per shipped template: (name, start marker, end marker), or None where the template knows no reasoning
# (it neither writes reasoning back nor opens a block nor names a thinking marker). Before this change: 0 of 70.
REASONING = {
    "Apertus-8B-Instruct": ("apertus", "<|inner_prefix|>", "<|inner_suffix|>"),
    "Apriel-1.6-15b-Thinker-fixed": ("apriel", "Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]"),
    "Bielik-11B-v3.0-Instruct": ("think", "<think>", "</think>"),
    "ByteDance-Seed-OSS": ("seed-oss", "<seed:think>", "</seed:think>"),
    "Cohere2MoE": ("command-r", "<|START_THINKING|>", "<|END_THINKING|>"),
    "CohereForAI-c4ai-command-r-plus-tool_use": None,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("command-r", "<|START_THINKING|>", "<|END_THINKING|>"),
    "GLM-4.6": ("think", "<think>", "</think>"),
    "GLM-4.7-Flash": ("think", "<think>", "</think>"),
    "GigaChat3-10B-A1.8B": None,
    "GigaChat3.1-10B-A1.8B": None,
    "HuggingFaceTB-SmolLM3-3B": ("think", "<think>", "</think>"),
    "Kimi-K2-Instruct": None,
    "Kimi-K2-Thinking": ("think", "<think>", "</think>"),
    "Kimi-K3": ("custom", "<|sep|>", "<|close|>think<|sep|><|open|>response<|sep|>"),
    "LFM2-8B-A1B": None,
    "LFM2.5-8B-A1B": ("think", "<think>", "</think>"),
    "LFM2.5-Instruct": None,
    "MiMo-VL": None,
    "MiniMax-M1": None,
    "MiniMax-M2": ("think", "<think>", "</think>"),
    "MiniMax-M3": ("minimax-m3", "<mm:think>", "</mm:think>"),
    "Mistral-Small-3.2-24B-Instruct-2506": None,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("think", "<think>", "</think>"),
    "NVIDIA-Nemotron-Nano-v2": ("think", "<think>", "</think>"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": None,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": None,
    "Qwen-QwQ-32B": ("think", "<think>", "</think>"),
    "Qwen-Qwen2.5-7B-Instruct": None,
    "Qwen-Qwen3-0.6B": ("think", "<think>", "</think>"),
    "Qwen3-Coder": None,
    "Qwen3.5-4B": ("think", "<think>", "</think>"),
    "Reka-Edge": ("think", "<think>", "</think>"),
    "Spark2.5": ("think", "<think>", "</think>"),
    "StepFun3.5-Flash": ("think", "<think>", "</think>"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("think", "<think>", "</think>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("think", "<think>", "</think>"),
    "deepseek-ai-DeepSeek-V3.1": ("think", "<think>", "</think>"),
    "deepseek-ai-DeepSeek-V3.2": ("think", "<think>", "</think>"),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("think", "<think>", "</think>"),
    "deepseek-ai-DeepSeek-V4": ("think", "<think>", "</think>"),
    "fireworks-ai-llama-3-firefunction-v2": None,
    "google-gemma-2-2b-it": None,
    "google-gemma-4-31B-it-interleaved": ("gemma4", "<|channel>thought", "<channel|>"),
    "google-gemma-4-31B-it": ("gemma4", "<|channel>thought", "<channel|>"),
    "ibm-granite-granite-3.3-2B-Instruct": ("think", "<think>", "</think>"),
    "ibm-granite-granite-4.0": None,
    "ibm-granite-granite-4.1": None,
    "inclusionai-ling-3.0-flash": ("think", "<think>", "</think>"),
    "llama-cpp-deepseek-r1": ("think", "<think>", "</think>"),
    "llama-cpp-rwkv-world": ("think", "<think>", "</think>"),
    "meetkai-functionary-medium-v3.1": None,
    "meetkai-functionary-medium-v3.2": None,
    "meta-llama-Llama-3.1-8B-Instruct": None,
    "meta-llama-Llama-3.2-3B-Instruct": None,
    "meta-llama-Llama-3.3-70B-Instruct": None,
    "microsoft-Phi-3.5-mini-instruct": None,
    "mistralai-Ministral-3-14B-Reasoning-2512": ("mistral", "[THINK]", "[/THINK]"),
    "mistralai-Mistral-Nemo-Instruct-2407": None,
    "moonshotai-Kimi-K2": None,
    "muse-glimmer": ("custom", "to=self<|message|>", "<|eom|>"),
    "openai-gpt-oss-120b": ("harmony", "<|channel|>analysis<|message|>", "<|end|>"),
    "openbmb-MiniCPM5-1B": ("think", "<think>", "</think>"),
    "poolside-Laguna-S-2.1": ("think", "<think>", "</think>"),
    "poolside-Laguna-XS-2.1": ("think", "<think>", "</think>"),
    "poolside-Laguna-XS.2": ("think", "<think>", "</think>"),
    "tencent-Hy3": ("hunyuan", "<think:opensource>", "</think:opensource>"),
    "unsloth-Apriel-1.5": ("thinking-tags", "<thinking>", "</thinking>"),
    "unsloth-mistral-Devstral-Small-2507": None,
    "upstage-Solar-Open-100B": ("solar", "<|think|>", "<|end|>"),
}

# llama.cpp cases whose expected parse this splitter does not reproduce, and why (each is a family's tool-call
# format or its clean-up of malformed output, not the reasoning split itself).
DIVERGES = {
    2831: "reasoning_format none: llama.cpp still drops the answer's wrapper markers",
    2883: "reasoning_format none: llama.cpp still drops the answer's wrapper markers",
    6211: "Apriel 1.6: llama.cpp keeps the prompt's 'Here are my reasoning steps:' in the reasoning",
    6442: "reasoning_format none: llama.cpp still drops harmony's final-channel header",
    6567: "gpt-oss: llama.cpp skips a malformed commentary header before the analysis, and keeps the analysis",
}


def template(name: str) -> ChatTemplate:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} not present (make test extracts llama.cpp's templates under bench/.build)")
    return ChatTemplate.from_file(path, bos_token="<s>", eos_token="</s>")


def test_the_table_covers_every_shipped_template():
    if not TEMPLATES.is_dir():
        pytest.skip(f"{TEMPLATES} not present")
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(REASONING)


@pytest.mark.parametrize("name", sorted(REASONING))
def test_reasoning_format_of_each_template(name):
    fmt = template(f"{name}.jinja").reasoning
    got = None if fmt is None else (fmt.name, fmt.start, fmt.end)
    assert got == REASONING[name]


def _end_of_turn(t: ChatTemplate) -> str | None:
    """The marker the template writes after an answer (the engine stops there; llama.cpp's inputs keep it)."""
    user = {"role": "user", "content": "q"}
    full = t.render([user, {"role": "assistant", "content": PROBE_ANSWER}], add_generation_prompt=False)
    m = re.match(r"<[^<>]+>|\[[^\[\]]+\]", full[full.find(PROBE_ANSWER) + len(PROBE_ANSWER) :].strip())
    return m.group(0) if m else None


SIMPLE = [c for c in CASES if c["other_settings"] in ("", ".expect_reconstruction()")]


@pytest.mark.parametrize("case", SIMPLE, ids=[f"{c['template'][:-6]}:{c['line']}" for c in SIMPLE])
def test_llamacpp_expected_parse(case):
    """test-chat.cpp's case, fed one character at a time; compared as llama.cpp compares (whitespace stripped)."""
    if case["line"] in DIVERGES:
        pytest.skip(DIVERGES[case["line"]])
    t = template(case["template"])
    fmt = t.reasoning
    thinking = case["enable_thinking"] is not False
    prompt = t.render([{"role": "user", "content": "Hey there!"}], enable_thinking=thinking)
    text = case["input"]
    eot = _end_of_turn(t)
    if fmt is not None and eot:
        after = text.find(fmt.end) + len(fmt.end) if fmt.end in text else 0
        if text.find(eot, after) != -1:
            text = text[: text.find(eot, after)]
    if fmt is None or case["reasoning_format"] in (None, "none"):
        opened = fmt is not None and fmt.opened_in(prompt)
        content = (prompt[prompt.rfind(fmt.start) :] if opened else "") + text
        reasoning = ""
    else:
        splitter = ReasoningSplitter(fmt, fmt.opened_in(prompt))
        frame = tool_format(t)  # a format that frames every answer reads it, tools or not (harmony, Muse)
        parser = frame.reply_parser(()) if frame.frames else None
        asm = ReplyAssembler(parser, CallChecker(()), True, splitter)
        for ch in text:
            asm.feed(ch)
        _, reply = asm.finish("stop")
        reasoning, content = reply.reasoning or "", reply.content or ""
    assert (content.strip(), reasoning.strip()) == (
        case["expect_content"].strip(),
        case["expect_reasoning"].strip(),
    )


# ---- prompts ---------------------------------------------------------------------------------------------


def _prompt(name: str, **reasoning):
    t = template(name)
    req = ChatRequest([{"role": "user", "content": "hi"}], reasoning=ReasoningRequest(**reasoning))
    return build_prompt(t, None, req, {}, t.reasoning)


def test_thinking_off_closes_the_block_where_the_template_has_no_switch():
    on = _prompt("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja")
    assert on.text.endswith("<think>\n") and on.opened and on.reasoning is not None
    off = _prompt("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", mode="off")
    assert off.text.endswith("<think>\n\n</think>\n\n") and not off.opened and off.reasoning is None


def test_thinking_off_uses_the_templates_own_switch():
    off = _prompt("Qwen-Qwen3-0.6B.jinja", mode="off")
    assert off.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.reasoning is None
    on = _prompt("Qwen-Qwen3-0.6B.jinja")
    assert on.text.endswith("<|im_start|>assistant\n") and not on.opened and on.reasoning is not None


def test_reasoning_format_none_keeps_the_block_in_the_content():
    """--reasoning-format none: the reply as written, starting with the block the prompt opened (as llama.cpp)."""
    prompt = _prompt("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", separate=False)
    asm = prompt.assembler()
    for piece in ("Let me ", "see.</think>", "\n\nParis."):
        asm.feed(piece)
    _, reply = asm.finish("stop")
    assert (reply.content, reply.reasoning) == ("<think>\nLet me see.</think>\n\nParis.", None)


def test_reasoning_asked_of_a_template_without_it_is_a_400():
    with pytest.raises(InvalidRequestError) as e:
        _prompt("Qwen-Qwen2.5-7B-Instruct.jinja", asked="thinking")
    assert e.value.param == "thinking"


def test_earlier_reasoning_goes_back_as_the_family_keeps_it():
    """Qwen3 keeps the reasoning of the last turn only; its template is given it under reasoning_content."""
    t = template("Qwen-Qwen3-0.6B.jinja")
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one", "reasoning": "old thought"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "two", "reasoning_content": "new thought"},
    ]
    text = build_prompt(t, None, ChatRequest(messages, continue_final=True), {}, t.reasoning).text
    assert "new thought" in text and "old thought" not in text


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja", "Qwen3.5-4B.jinja"])
def test_a_grammar_after_reasoning_is_lazy_in_the_block(name):
    """response_format on a thinking model: free text in the block, the schema from its end on."""
    t = template(name)
    req = ChatRequest([{"role": "user", "content": "hi"}], response_schema={"type": "object"})
    prompt = build_prompt(t, None, req, {}, t.reasoning)
    assert llguidance.LLMatcher.validate_grammar(prompt.grammar.source) == ""
    assert prompt.grammar.source != json_schema_grammar({"type": "object"}, param="x").source


# ---- the engine's budget ---------------------------------------------------------------------------------


def _run(state: ThinkState, pieces: list[bytes], sampled: int = 7) -> list[int]:
    taken = []
    for piece in pieces:
        token = state.next_token(sampled) if state.forcing else sampled
        taken.append(token)
        state.observe(piece if token == sampled else f"<{token}>".encode())
    return taken


def test_budget_forces_the_end_marker_then_lets_the_model_answer():
    spec = ThinkingSpec(b"<think>", b"<2>", opened=True, budget=3, forced=(1, 2))
    state = ThinkState(spec)
    taken = _run(state, [b"a", b"b", b"c", b"x", b"y", b"z", b"w"])
    assert taken == [7, 7, 7, 1, 2, 7, 7]
    assert state.count == 3 and state.state == "done"


def test_a_block_the_model_opens_and_closes_itself_is_counted_not_forced():
    spec = ThinkingSpec(b"<think>", b"</think>", opened=False, budget=10, forced=(1,))
    state = ThinkState(spec)
    taken = _run(state, [b"<th", b"ink>", b"a", b"b", b"</think>", b"answer"])
    assert taken == [7] * 6
    assert state.count == 3 and state.state == "done"
