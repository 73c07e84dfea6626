"""What a thinking model's chat format costs per token: the reasoning splitter, the family's tool-call parser and
the lazy grammar (free text in the thinking block, the tools' schemas from its end on), against the very same
prompt decoded without any of them, on quantserve's llama.cpp and torch backends, in one run.

Usage: .venv/bin/python bench/chat_formats.py [--rounds 3] [--pairs 3] [--threads 2]
Writes bench/results/chat-formats-<date>.md and .json.

SmolLM2 is served with Qwen 3.5's template (`--chat-template`: its prompt opens a <think> block, and its tool calls
are Qwen3-Coder's XML) and `--reasoning-budget 24`, which closes the block (SmolLM2 never does). Each pair, back
to back on one server: a streamed chat request with a tool (`tool_choice: auto`), which goes through the
splitter, the parser and the grammar; then the same prompt text sent to /v1/completions with `ignore_eos` for the
same number of tokens, which goes through none of them. Decode time per token is measured at the client,
(last chunk - first chunk) / (tokens - 1), every request asking for logprobs so that each token sends its chunk.
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


def prompt_text(tag: str) -> str:
    """The prompt the chat request renders (the tool described, the think block opened), built the server's way."""
    from quantserve.chat import ChatRequest, ChatTemplate, ToolChoice, build_prompt, tool_format
    from quantserve.chat.reasoning import ReasoningRequest
    from quantserve.chat.tools import parse_openai_tools

    t = ChatTemplate.from_file(TEMPLATE, bos_token="", eos_token="<|endoftext|>")
    req = ChatRequest(
        messages(tag), parse_openai_tools([TOOL]), ToolChoice("auto"), reasoning=ReasoningRequest()
    )
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
            if chunk.get("choices"):
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
    pairs: dict[str, list[tuple[float, float, int]]] = {d.name: [] for d in defs}
    logs = Path(tempfile.mkdtemp(prefix="qs-chat-formats-"))
    for rnd in range(args.rounds):
        for sd in defs:
            log = logs / f"{sd.name.replace(' ', '-')}-{rnd}.log"
            proc = start(sd, log)
            try:
                wait_serving(sd, proc, log, 300)
                url = f"http://127.0.0.1:{sd.port}"
                model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                chat = {"model": model, "tools": [TOOL], "tool_choice": "auto", "max_tokens": 96}
                timed(url, "/v1/chat/completions", {**chat, "messages": messages("warmup")})
                for k in range(args.pairs):
                    tag = f"r{rnd}.{k}"
                    spt_c, n = timed(url, "/v1/chat/completions", {**chat, "messages": messages(tag)})
                    plain = {"model": model, "prompt": prompt_text(tag), "max_tokens": n, "ignore_eos": True}
                    spt_u, _ = timed(url, "/v1/completions", plain)
                    pairs[sd.name].append((spt_c, spt_u, n))
                    print(
                        f"round {rnd} {sd.name:19s} {1000 * spt_c:6.2f} vs {1000 * spt_u:6.2f} ms/token "
                        f"({n} tokens): {spt_c / spt_u:.3f}",
                        flush=True,
                    )
            finally:
                stop(proc)
    write(args, defs, pairs)


def write(args, defs, pairs) -> None:
    med = statistics.median
    stamp = dt.datetime.now(dt.UTC)
    info, vers = machine_info(), versions(None)
    rows = {s: (med([a / b for a, b, _ in v]), 1000 * med([a for a, _, _ in v]), 1000 * med([b for _, b, _ in v]))
            for s, v in pairs.items()}  # fmt: skip
    lines = [
        "# A thinking model's chat format: cost per token against the same prompt without it",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/chat_formats.py --rounds "
        f"{args.rounds} --pairs {args.pairs} --threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "",
        "SmolLM2-135M-Instruct (the Q4_1 GGUF on the llama.cpp backend; its fp32 HF checkpoint on the torch "
        f"backend, CPU), served with Qwen 3.5's template and `--reasoning-budget {BUDGET}`. Each pair: a streamed "
        "chat request with a tool, `tool_choice: auto` (the reasoning splitter, the qwen3-coder parser and the "
        "lazy grammar all at work), then the same prompt text on /v1/completions with ignore_eos for the same "
        "number of tokens (none of them). Ratio: chat / completions per token, median over all pairs.",
        "Servers: "
        + "; ".join(f"`{' '.join(Path(c).name if '/' in c else c for c in d.cmd)}`" for d in defs),
        "",
        "| server | chat with reasoning and tools / same prompt plain, ms per token | ratio |",
        "|---|---|---|",
    ]
    for s, (ratio, c, u) in rows.items():
        lines.append(f"| {s} | {c:.2f} / {u:.2f} | **{ratio:.3f}** |")
    data = {"measured": stamp.isoformat(), "machine": info, "versions": vers, "pairs": pairs}
    save_record(args.out, f"chat-formats-{stamp:%Y-%m-%d}", lines, data)


if __name__ == "__main__":
    main()
