"""What constrained decoding costs per token: a json_schema reply and a required tool call against the same
request without constraints, on quantserve's llama.cpp and torch backends and on native llama-server (same GGUF,
same schemas), one server at a time, in one run.

Usage: .venv/bin/python bench/constrained.py [--rounds 3] [--pairs 3] [--threads 2] [--llama-server PATH]
Writes bench/results/constrained-<date>.md and .json.

Decode time per token is measured at the client from one streaming request: (last chunk - first chunk) /
(completion tokens - 1), so prefill and the first token's latency are left out; every request asks for logprobs,
so that each token sends its chunk at once (on both servers). Each measurement is a matched pair,
back to back on the same server: the constrained request, then the same prompt unconstrained (ignore_eos) for the
same number of tokens, so that neither the VM's drift (3-12 % from minute to minute here) nor the length of the
reply (attention grows with it) lands in the ratio. Each cell is the median over --rounds x --pairs pairs, servers
in turn. Every request is greedy and single-stream.
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

from serving import ServerDef, free_port, machine_info, start, stop, versions, wait_serving  # noqa: E402

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


def tool_call_schema() -> dict:
    """The JSON a required call of TOOL is held to in the generic format (SmolLM2's template knows no tools)."""
    from quantserve.chat.formats.generic import _calls_schema
    from quantserve.chat.tools import parse_openai_tools

    return _calls_schema(parse_openai_tools([TOOL]), parallel=False)


def generic_messages(messages: list[dict]) -> list[dict]:
    """`messages` as quantserve renders them with TOOL in the generic format (the tools described in the system
    turn): a request with these messages and no tools has the very prompt of the tool-call request."""
    from quantserve.chat import ChatTemplate, ToolChoice, tool_format
    from quantserve.chat.tools import parse_openai_tools
    from quantserve.formats import read_gguf_info

    gguf = resolve("smollm2", load_registry(find_models_toml(None))).path
    fmt = tool_format(ChatTemplate(read_gguf_info(gguf).chat_template))
    return fmt.prepare(messages, parse_openai_tools([TOOL]), ToolChoice("required"), False)[0]


def cases(tag: str, native: bool = False) -> dict[str, tuple[dict, list[dict]]]:
    """(constrained request, the messages of its unconstrained twin): `tag` keeps prompts distinct between pairs
    (no whole-prompt cache hits). The tool-call request's twin carries the tool instructions quantserve puts in the
    system turn, so that both decode after the same prompt.

    llama-server does not enforce tool_choice "required" for a template that knows no tools (it answers SmolLM2
    in prose), so it gets the same grammar as a json_schema response_format, after the same prompt: `native`."""
    facts = [SYSTEM, {"role": "user", "content": f"[{tag}] Tell me about Paris: its country and six facts."}]
    event = [
        SYSTEM,
        {"role": "user", "content": f"[{tag}] Plan a team dinner in Paris next Friday for three people."},
    ]
    prompted = generic_messages(event)
    call = {"messages": event, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    if native:
        schema = {"name": "c", "schema": tool_call_schema()}
        call = {"messages": prompted, "response_format": {"type": "json_schema", "json_schema": schema}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    return {
        "json_schema": ({"messages": facts, "max_tokens": 300, "response_format": json_schema}, facts),
        "tool_call": ({**call, "max_tokens": 300}, prompted),
    }


def unconstrained(messages: list[dict], n_tokens: int) -> dict:
    """The twin: a prompt without constraints, for exactly n_tokens."""
    return {"messages": messages, "max_tokens": n_tokens, "ignore_eos": True}


def one_request(base_url: str, body: dict) -> tuple[float, int]:
    """(seconds per decoded token, completion tokens) of one streamed chat request.

    logprobs are asked for so that every token sends a chunk at once: a tool call's first delta waits until its
    name is complete, and text held back (a possible stop string or marker) would otherwise skew the timing."""
    body = {**body, "temperature": 0, "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    body["logprobs"] = True
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
            choice = (chunk.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or choice.get("logprobs"):
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
        defs.append(
            ServerDef("llama-server", (*cmd, "--host", "127.0.0.1", "--port", str(p)), p, ignore_eos=True)
        )
    return defs


def mask_cost(threads: int) -> dict[str, dict[str, float]]:
    """In-process, llama.cpp backend: the time each token's grammar mask takes (llguidance's mask computed and
    written into the logits, plus accepting the token), against the whole decode step, for both constrained cases."""
    import asyncio

    import quantserve.llm as qllm
    from quantserve.chat import ChatRequest, ToolChoice
    from quantserve.chat.tools import parse_openai_tools
    from quantserve.structured import guide

    llm = qllm.load("smollm2", threads=threads, max_num_seqs=1)
    spent: list[float] = []
    mask, accept = guide.Guide.mask, guide.Guide.accept

    def timed(fn):
        def wrapper(*a):
            t = time.perf_counter()
            out = fn(*a)
            spent.append(time.perf_counter() - t)
            return out

        return wrapper

    guide.Guide.mask, guide.Guide.accept = timed(mask), timed(accept)
    requests = {
        "json_schema": ChatRequest(cases("m")["json_schema"][0]["messages"], response_schema=SCHEMA),
        "tool_call": ChatRequest(
            cases("m")["tool_call"][0]["messages"], parse_openai_tools([TOOL]), ToolChoice("required"), False
        ),
    }

    async def run(req: ChatRequest) -> tuple[int, float]:
        prompt, tokens = llm.prepare_chat(req)
        params = llm.sampling_params(max_tokens=300, temperature=0, grammar=prompt.grammar)
        first, n = None, 0
        async for out in llm.generate(tokens, params):
            first, n = first or time.perf_counter(), out.num_output_tokens
        return n, time.perf_counter() - first

    out = {}
    try:
        for name, req in requests.items():
            asyncio.run(run(req))  # builds the vocabulary and caches the prompt
            spent.clear()
            n, decode = asyncio.run(run(req))
            out[name] = {"tokens": n, "mask_us": 1e6 * sum(spent) / n, "decode_ms": 1e3 * decode / (n - 1)}
            print(
                f"in-process {name}: grammar {out[name]['mask_us']:.0f} us per token, decode {out[name]['decode_ms']:.2f} ms"
            )
    finally:
        guide.Guide.mask, guide.Guide.accept = mask, accept
        llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=3, help="matched pairs per case, server and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, default=ROOT / "bench/.build/llama-server")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    native = args.llama_server if args.llama_server.is_file() else None
    if native is None:
        print(
            f"no llama-server at {args.llama_server} (bench/build_llama_server.sh builds it); measuring without it"
        )
    gguf = resolve("smollm2", load_registry(find_models_toml(None))).path
    defs = server_defs(gguf, args.threads, native)
    in_process = mask_cost(args.threads)
    pairs: dict[str, dict[str, list[tuple[float, float, int]]]] = {d.name: {} for d in defs}
    logs = Path(tempfile.mkdtemp(prefix="qs-constrained-"))
    for rnd in range(args.rounds):
        for sd in defs:
            log = logs / f"{sd.name.replace(' ', '-')}-{rnd}.log"
            proc = start(sd, log)
            try:
                wait_serving(sd, proc, log, 300)
                url = f"http://127.0.0.1:{sd.port}"
                one_request(url, cases("warmup")["json_schema"][0])  # a first grammar request pays for setup
                for k in range(args.pairs):
                    for name, (body, twin) in cases(f"r{rnd}.{k}", native=sd.name == "llama-server").items():
                        spt_c, n = one_request(url, body)
                        spt_u, _ = one_request(url, unconstrained(twin, n))
                        pairs[sd.name].setdefault(name, []).append((spt_c, spt_u, n))
                        print(
                            f"round {rnd} {sd.name:19s} {name:11s} {1000 * spt_c:6.2f} vs {1000 * spt_u:6.2f} "
                            f"ms/token unconstrained ({n} tokens): {spt_c / spt_u:.3f}",
                            flush=True,
                        )
            finally:
                stop(proc)
    write(args, defs, pairs, native, in_process)


def write(args, defs, pairs, native, in_process) -> None:
    def med(values) -> float:
        return statistics.median(values)

    stamp = dt.datetime.now(dt.UTC)
    name = f"constrained-{stamp:%Y-%m-%d}"
    info, vers = machine_info(), versions(native)
    ratios = {s: {c: med([a / b for a, b, _ in v]) for c, v in cs.items()} for s, cs in pairs.items()}
    ms = {s: {c: (1000 * med([a for a, _, _ in v]), 1000 * med([b for _, b, _ in v])) for c, v in cs.items()}
          for s, cs in pairs.items()}  # fmt: skip
    lines = [
        "# Constrained decoding: cost per token against the same request without constraints",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/constrained.py --rounds {args.rounds} "
        f"--pairs {args.pairs} --threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "",
        "SmolLM2-135M-Instruct: the Q4_1 GGUF for quantserve's llama.cpp backend and llama-server; for the torch "
        "backend, its HF checkpoint (fp32, from our GGUF -> HF converter) on the CPU. One stream, greedy. Decode "
        "time per token = (last chunk - first chunk) / (completion tokens - 1), at the client. Each pair: the "
        "constrained request, then the same prompt unconstrained (ignore_eos) for the same number of tokens; the "
        "ratio is constrained / unconstrained, median over all pairs.",
        "Servers: "
        + "; ".join(f"`{' '.join(Path(c).name if '/' in c else c for c in d.cmd)}`" for d in defs),
        "",
        "llama-server does not enforce `tool_choice: required` for SmolLM2's template (it answers in prose), so its "
        "tool_call case is the same JSON grammar sent as a json_schema response_format (the generic format's "
        "schema for one call of the tool), after the same prompt (the tool described in the system turn, as "
        "quantserve renders it). Every unconstrained twin has its constrained request's prompt.",
        "",
        "| server | json_schema: constrained / unconstrained ms per token | ratio | tool_call (required) | ratio |",
        "|---|---|---|---|---|",
    ]
    for s in pairs:
        (jc, ju), (tc, tu) = ms[s]["json_schema"], ms[s]["tool_call"]
        lines.append(
            f"| {s} | {jc:.2f} / {ju:.2f} | **{ratios[s]['json_schema']:.3f}** | {tc:.2f} / {tu:.2f} "
            f"| **{ratios[s]['tool_call']:.3f}** |"
        )
    if "llama-server" in pairs:
        lines += [
            "",
            "quantserve's constrained decode per token against llama-server's (medians, same requests):",
            "",
        ]
        ls = ms["llama-server"]
        for s in pairs:
            if s != "llama-server":
                j, t = (
                    ms[s]["json_schema"][0] / ls["json_schema"][0],
                    ms[s]["tool_call"][0] / ls["tool_call"][0],
                )
                lines.append(f"- {s}: json_schema {j:.3f}x, tool_call {t:.3f}x llama-server's time per token")
    lines += [
        "",
        "In process (llama.cpp backend, no HTTP): what the grammar itself costs per token, llguidance's mask computed "
        "and written into the logits plus the token accepted, against the decode step it sits in:",
        "",
    ]
    for c, m in in_process.items():
        lines.append(
            f"- {c}: {m['mask_us']:.0f} us per token, {m['decode_ms']:.2f} ms per decode step "
            f"({m['tokens']} tokens): {m['mask_us'] / 10 / m['decode_ms']:.1f} % of a step"
        )
    lines += ["", "Every pair (constrained / unconstrained ms per token, tokens):", ""]
    for s, cs in pairs.items():
        for c, v in cs.items():
            runs = ", ".join(f"{1000 * a:.2f}/{1000 * b:.2f} ({n})" for a, b, n in v)
            lines.append(f"- {s}, {c}: {runs}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    data = {
        "machine": info,
        "versions": vers,
        "pairs_seconds_per_token": pairs,
        "ratio_median": ratios,
        "in_process": in_process,
    }
    (args.out / f"{name}.json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))
    print(f"wrote {args.out / name}.md")


if __name__ == "__main__":
    main()
