"""What constrained decoding costs per token: a json_schema reply and a required tool call against the same kind of
request without constraints, on quantserve's llama.cpp and torch backends and on native llama-server (same GGUF,
same schemas), one server at a time, in one run.

Usage: .venv/bin/python bench/constrained.py [--rounds 5] [--threads 2] [--llama-server PATH]
Writes bench/results/constrained-<date>.md and .json.

Decode time per token is measured at the client from one streaming request: (last chunk - first chunk) /
(completion tokens - 1), so prefill and the first token's latency are left out; each cell is the median over
--rounds requests, servers in turn. Every request is greedy and single-stream.
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

from serving import free_port, machine_info, start, stop, versions, wait_serving, ServerDef  # noqa: E402

from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}, "minItems": 6, "maxItems": 6},
    },
    "required": ["city", "country", "facts"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "create_event",
        "description": "Put an event in the calendar",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "date": {"type": "string", "description": "YYYY-MM-DD"},
                "place": {"type": "string"},
                "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3},
                "notes": {"type": "string"},
            },
            "required": ["title", "date", "place", "attendees", "notes"],
            "additionalProperties": False,
        },
    },
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def cases(tag: str) -> dict[str, dict]:
    """Each case's request; `tag` keeps prompts distinct between rounds (no whole-prompt cache hits)."""
    facts = [SYSTEM, {"role": "user", "content": f"[{tag}] Tell me about Paris: its country and six facts."}]
    event = [SYSTEM, {"role": "user", "content": f"[{tag}] Plan a team dinner in Paris next Friday for three people."}]
    return {
        "plain": {"messages": facts, "max_tokens": 96, "ignore_eos": True},
        "json_schema": {
            "messages": facts,
            "max_tokens": 400,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        },
        "plain (tool prompt)": {"messages": event, "max_tokens": 96, "ignore_eos": True},
        "tool_call": {
            "messages": event,
            "max_tokens": 400,
            "tools": [TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
    }


def one_request(base_url: str, body: dict) -> tuple[float, int]:
    """(seconds per decoded token, completion tokens) of one streamed chat request."""
    body = {**body, "temperature": 0, "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    stamps, tokens, timings = [], None, None
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            timings = chunk.get("timings") or timings
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                stamps.append(time.perf_counter())
    if tokens is None and timings:
        tokens = timings.get("predicted_n")
    if not tokens or tokens < 2 or len(stamps) < 2:
        raise RuntimeError(f"too short a reply to time ({tokens} tokens)")
    return (stamps[-1] - stamps[0]) / (tokens - 1), tokens


def hf_checkpoint(gguf: Path) -> Path:
    """SmolLM2 as a HF checkpoint (our GGUF -> HF converter), made once under bench/.build."""
    out = ROOT / "bench/.build/smollm2-hf"
    if not (out / "config.json").is_file():
        from quantserve.converters import gguf_to_hf

        gguf_to_hf(gguf, out, dtype="fp32", progress=False)
    return out


def server_defs(gguf: Path, threads: int, native: Path | None) -> list[ServerDef]:
    py, t = sys.executable, str(threads)
    defs = []
    for backend, src in (("llamacpp", gguf), ("torch", hf_checkpoint(gguf))):
        p = free_port()
        cmd = (py, "-m", "quantserve.cli", "run", str(src), "--backend", backend, "--threads", t)
        cmd += ("--max-num-seqs", "1", "--ctx-size", "2048", "--port", str(p), "--log-level", "warning")
        defs.append(ServerDef(f"quantserve {backend}", cmd, p, ignore_eos=True))
    if native is not None:
        p = free_port()
        cmd = (str(native), "-m", str(gguf), "-np", "1", "-t", t, "-tb", t, "-c", "2048", "--jinja")
        defs.append(ServerDef("llama-server", (*cmd, "--host", "127.0.0.1", "--port", str(p)), p, ignore_eos=True))
    return defs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, default=ROOT / "bench/.build/llama-server")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    native = args.llama_server if args.llama_server.is_file() else None
    if native is None:
        print(f"no llama-server at {args.llama_server} (bench/build_llama_server.sh builds it); measuring without it")
    gguf = resolve("smollm2", load_registry(find_models_toml(None))).path
    defs = server_defs(gguf, args.threads, native)
    results: dict[str, dict[str, list[float]]] = {d.name: {} for d in defs}
    lengths: dict[str, dict[str, list[int]]] = {d.name: {} for d in defs}
    logs = Path(tempfile.mkdtemp(prefix="qs-constrained-"))
    for rnd in range(args.rounds):
        for sd in defs:
            log = logs / f"{sd.name.replace(' ', '-')}-{rnd}.log"
            proc = start(sd, log)
            try:
                wait_serving(sd, proc, log, 300)
                url = f"http://127.0.0.1:{sd.port}"
                one_request(url, cases("warmup")["json_schema"])  # the first grammar builds the vocabulary once
                for name, body in cases(f"r{rnd}").items():
                    spt, n = one_request(url, body)
                    results[sd.name].setdefault(name, []).append(spt)
                    lengths[sd.name].setdefault(name, []).append(n)
                    print(f"round {rnd} {sd.name:18s} {name:20s} {1000 * spt:6.2f} ms/token ({n} tokens)", flush=True)
            finally:
                stop(proc)
    write(args, defs, results, lengths, native)


def write(args, defs, results, lengths, native) -> None:
    med = {s: {c: statistics.median(v) for c, v in cs.items()} for s, cs in results.items()}
    stamp = dt.datetime.now(dt.UTC)
    name = f"constrained-{stamp:%Y-%m-%d}"
    info, vers = machine_info(), versions(native)
    lines = [
        "# Constrained decoding: cost per token against the same request without constraints",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/constrained.py --rounds {args.rounds} "
        f"--threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "",
        "SmolLM2-135M-Instruct: the Q4_1 GGUF for quantserve's llama.cpp backend and llama-server; for the torch "
        "backend, its HF checkpoint (fp32, from our GGUF -> HF converter) on the CPU. One stream, greedy; decode time "
        "per token = (last chunk - first chunk) / (completion tokens - 1), at the client; median of the rounds.",
        "Servers: " + "; ".join(f"`{' '.join(Path(c).name if '/' in c else c for c in d.cmd)}`" for d in defs),
        "",
        "| server | plain | json_schema | ratio | plain (tool prompt) | tool_call (required) | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, m in med.items():
        j, t = m["json_schema"] / m["plain"], m["tool_call"] / m["plain (tool prompt)"]
        lines.append(
            f"| {s} | {1000 * m['plain']:.2f} ms | {1000 * m['json_schema']:.2f} ms | **{j:.3f}** "
            f"| {1000 * m['plain (tool prompt)']:.2f} ms | {1000 * m['tool_call']:.2f} ms | **{t:.3f}** |"
        )
    if "llama-server" in med:
        ls = med["llama-server"]
        lines += ["", "quantserve's constrained decode per token against llama-server's, same request:", ""]
        for s, m in med.items():
            if s != "llama-server":
                lines.append(
                    f"- {s}: json_schema {m['json_schema'] / ls['json_schema']:.3f}x, "
                    f"tool_call {m['tool_call'] / ls['tool_call']:.3f}x llama-server's time per token"
                )
    lines += ["", "Every round (ms per token; completion tokens):", ""]
    for s, cs in results.items():
        for c, v in cs.items():
            runs = ", ".join(f"{1000 * x:.2f} ({n})" for x, n in zip(v, lengths[s][c], strict=True))
            lines.append(f"- {s}, {c}: {runs}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    data = {"machine": info, "versions": vers, "seconds_per_token": results, "tokens": lengths, "median": med}
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))
    print(f"wrote {args.out / name}.md")


if __name__ == "__main__":
    main()
