"""What a thinking model's chat format costs per token: the reasoning splitter, the family's tool-call parser and
the lazy grammar (free text in the thinking block, the tools' schemas from its end on), against the very same
prompt decoded without any of them, on quantserve's llama.cpp and torch backends, in one run.

Usage: .venv/bin/python bench/chat_formats.py [--rounds 3] [--pairs 3] [--threads 2]
Writes bench/results/chat-formats-<date>.md and .json.

SmolLM2 is served with Qwen 3.5's template (`--chat-template`: its prompt opens a <think> block, and its tool calls
are Qwen3-Coder's XML) and `--reasoning-budget 24`, which closes the block (SmolLM2 never does). Each pair, back
to back on one server: a streamed chat request with a tool (`tool_choice: auto`), which goes through the
splitter, the parser and the grammar; then the same prompt text sent to /v1/completions with `ignore_eos` for the
same number of tokens, which goes through none of them. The plain chat request (no tool, thinking off) is paired
with its own prompt the same way, which gives the chat endpoint's own cost; the format's is the ratio of ratios. Decode time per token is measured at the client,
(last token's chunk - first token's chunk) / (tokens - 1), every request asking for logprobs so that each token
sends its chunk (the chat stream's opening chunk, sent before the prefill, is not a token's).
The ratio is the first over the second, median over --rounds x --pairs pairs per backend.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from constrained import hf_checkpoint  # noqa: E402
from serving import ServerDef, free_port, machine_info, save_record, start, stop, versions, wait_serving  # noqa: E402

from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

TEMPLATE = ROOT / "bench/.build/src/vendor/llama.cpp/models/templates/Qwen3.5-4B.jinja"
BUDGET = 24
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def messages(tag: str) -> list[dict]:
    return [{"role": "user", "content": f"[{tag}] What will the weather be like in Paris this week?"}]


def prompt_text(tag: str, thinks: bool) -> str:
    """The prompt a chat request renders, built the server's way: with the tool and the think block opened, or
    (the plain request) neither."""
    from quantserve.chat import ChatRequest, ChatTemplate, ToolChoice, build_prompt, tool_format
    from quantserve.chat.reasoning_request import ReasoningRequest
    from quantserve.chat.tools import parse_openai_tools

    t = ChatTemplate.from_file(TEMPLATE, bos_token="", eos_token="<|endoftext|>")
    if thinks:
        tools, choice, mode = parse_openai_tools([TOOL]), ToolChoice("auto"), "auto"
    else:
        tools, choice, mode = (), ToolChoice("none"), "off"
    req = ChatRequest(messages(tag), tools, choice, reasoning=ReasoningRequest(mode=mode))
    return build_prompt(t, tool_format(t), req, {}, t.reasoning).text


def timed(url: str, path: str, body: dict) -> tuple[float, int]:
    """(seconds per decoded token, tokens) of one streamed request."""
    body = {**body, "temperature": 0, "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    body["logprobs"] = True if path.endswith("chat/completions") else 1
    stamps, tokens = [], None
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("logprobs"):  # a token's chunk (not the opening one, sent before the prefill)
                stamps.append(time.perf_counter())
    if not tokens or tokens < 8 or len(stamps) < 2:
        raise RuntimeError(f"too short a reply to time ({tokens} tokens)")
    return (stamps[-1] - stamps[0]) / (tokens - 1), tokens


def server_defs(threads: int) -> list[ServerDef]:
    gguf = resolve("smollm2", load_registry(find_models_toml(None))).path
    py, t = sys.executable, str(threads)
    defs = []
    for backend, src in (("llamacpp", gguf), ("torch", hf_checkpoint(gguf))):
        p = free_port()
        cmd = (py, "-m", "quantserve.cli", "run", str(src), "--backend", backend, "--threads", t)
        cmd += ("--chat-template", str(TEMPLATE), "--reasoning-budget", str(BUDGET))
        cmd += ("--max-num-seqs", "1", "--ctx-size", "2048", "--port", str(p), "--log-level", "warning")
        defs.append(ServerDef(f"quantserve {backend}", cmd, p, ignore_eos=True))
    return defs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    defs = server_defs(args.threads)
    pairs: dict[str, dict[str, list[tuple[float, float, int]]]] = {d.name: {} for d in defs}
    logs = Path(tempfile.mkdtemp(prefix="qs-chat-formats-"))
    for rnd in range(args.rounds):
        for sd in defs:
            log = logs / f"{sd.name.replace(' ', '-')}-{rnd}.log"
            proc = start(sd, log)
            try:
                wait_serving(sd, proc, log, 300)
                url = f"http://127.0.0.1:{sd.port}"
                model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                thinking = {"model": model, "tools": [TOOL], "tool_choice": "auto", "max_tokens": 96}
                off = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
                plain = {"model": model, "max_tokens": 96, **off}
                timed(url, "/v1/chat/completions", {**thinking, "messages": messages("warmup")})
                for k in range(args.pairs):
                    for case, body, thinks in (("thinking", thinking, True), ("plain", plain, False)):
                        tag = f"r{rnd}.{k}.{case}"
                        spt_c, n = timed(url, "/v1/chat/completions", {**body, "messages": messages(tag)})
                        raw = {"model": model, "prompt": prompt_text(tag, thinks), "max_tokens": n}
                        spt_u, _ = timed(url, "/v1/completions", {**raw, "ignore_eos": True})
                        pairs[sd.name].setdefault(case, []).append((spt_c, spt_u, n))
                        print(
                            f"round {rnd} {sd.name:19s} {case:8s} chat {1000 * spt_c:6.2f} vs completions "
                            f"{1000 * spt_u:6.2f} ms/token ({n} tokens): {spt_c / spt_u:.3f}",
                            flush=True,
                        )
            finally:
                stop(proc)
    write(args, defs, pairs)


def write(args, defs, pairs) -> None:
    med = statistics.median
    stamp = dt.datetime.now(dt.UTC)
    info, vers = machine_info(), versions(None)
    ratio = {s: {c: med([a / b for a, b, _ in v]) for c, v in cs.items()} for s, cs in pairs.items()}
    lines = [
        "# A thinking model's chat format: cost per token against the same request without it",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/chat_formats.py --rounds "
        f"{args.rounds} --pairs {args.pairs} --threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "",
        "SmolLM2-135M-Instruct (the Q4_1 GGUF on the llama.cpp backend; its fp32 HF checkpoint on the torch "
        f"backend, CPU), served with Qwen 3.5's template and `--reasoning-budget {BUDGET}`. A thinking pair: a "
        "streamed chat request with a tool, `tool_choice: auto` (the reasoning splitter, the qwen3-coder parser "
        "and the lazy grammar all at work), then the same prompt text on /v1/completions with ignore_eos for the "
        "same number of tokens (none of them). A plain pair: the same chat without the tool and with thinking "
        "off (ignore_eos, as long), then its own prompt on /v1/completions. The chat endpoint has per-token costs "
        "of its own (its chunks, its reply events), which the plain pair measures; the cost of reasoning and "
        "tools is the thinking ratio over the plain one. Ratios are medians over all pairs.",
        "Servers: "
        + "; ".join(f"`{' '.join(Path(c).name if '/' in c else c for c in d.cmd)}`" for d in defs),
        "",
        "| server | thinking + tools chat / completions | plain chat / completions | **reasoning + tools cost** |",
        "|---|---|---|---|",
    ]
    for s, r in ratio.items():
        lines.append(
            f"| {s} | {r['thinking']:.3f} | {r['plain']:.3f} | **{r['thinking'] / r['plain']:.3f}** |"
        )
    data = {"measured": stamp.isoformat(), "machine": info, "versions": vers, "pairs": pairs}
    save_record(args.out, f"chat-formats-{stamp:%Y-%m-%d}", lines, data)


if __name__ == "__main__":
    main()
