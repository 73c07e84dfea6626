"""What the prefix cache saves: time to first token of a second request that shares a ~1,000-token prefix with the
first, with the cache and without it (`--no-prefix-cache`), on the torch backend (CPU) and, for reference, the
llama.cpp backend. Same server, same requests, in one run.

Usage: .venv/bin/python bench/prefix_cache.py [--rounds 5] [--threads 2]
Writes bench/results/prefix-cache-<date>.md and .json.

Each round: a document of ~1,000 tokens (built-in text, tagged so rounds share nothing), a first question about it
(it fills the cache), then a second question about it, streamed: its TTFT is measured at the client.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from constrained import hf_checkpoint  # noqa: E402
from serving import ServerDef, free_port, machine_info, save_record, start, stop, versions, wait_serving  # noqa: E402

from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

DOCUMENT = " ".join((files("quantserve") / "data/eval.txt").read_text().split()[:700])  # ~1,000 tokens


def ttft(base_url: str, messages: list[dict]) -> float:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - t0
    raise RuntimeError("no content came back")


def prompts(tag: str) -> tuple[list[dict], list[dict]]:
    doc = {"role": "system", "content": f"[{tag}] Read this document.\n\n{DOCUMENT}"}
    return (
        [doc, {"role": "user", "content": "What is the document about?"}],
        [doc, {"role": "user", "content": "Give the document a title."}],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    gguf = resolve("smollm2", load_registry(find_models_toml(None))).path
    sources = {"torch": hf_checkpoint(gguf), "llamacpp": gguf}
    ttfts: dict[str, list[float]] = {}
    logs = Path(tempfile.mkdtemp(prefix="qs-prefix-"))
    for backend, src in sources.items():
        for cache in (True, False):
            name = f"{backend}, cache {'on' if cache else 'off'}"
            port = free_port()
            cmd = (sys.executable, "-m", "quantserve.cli", "run", str(src), "--backend", backend, "--threads",
                   str(args.threads), "--max-num-seqs", "1", "--ctx-size", "2048", "--port", str(port),
                   "--log-level", "warning") + (() if cache else ("--no-prefix-cache",))  # fmt: skip
            sd = ServerDef(name, cmd, port, ignore_eos=True)
            log = logs / f"{backend}-{cache}.log"
            proc = start(sd, log)
            try:
                wait_serving(sd, proc, log, 300)
                url = f"http://127.0.0.1:{port}"
                ttft(url, prompts("warmup")[0])
                for rnd in range(args.rounds):
                    first, second = prompts(f"{rnd}")
                    ttft(url, first)
                    ttfts.setdefault(name, []).append(ttft(url, second))
                    print(
                        f"{name:22s} round {rnd}: second request TTFT {1000 * ttfts[name][-1]:.0f} ms",
                        flush=True,
                    )
            finally:
                stop(proc)
    write(args, ttfts)


def write(args, ttfts: dict[str, list[float]]) -> None:
    stamp = dt.datetime.now(dt.UTC)
    name = f"prefix-cache-{stamp:%Y-%m-%d}"
    med = {k: statistics.median(v) for k, v in ttfts.items()}
    info = machine_info()
    lines = [
        "# Prefix caching: TTFT of a second request that shares a ~1,000-token prefix",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/prefix_cache.py --rounds "
        f"{args.rounds} --threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(None).items()),
        "",
        "SmolLM2-135M-Instruct: the fp32 HF checkpoint on the torch backend (CPU), the Q4_1 GGUF on the llama.cpp "
        "backend; one sequence at a time. Each round: a ~1,000-token document in the system turn and a first "
        "question, then a second question about the same document; the second request's TTFT at the client, median "
        "of the rounds.",
        "",
        "| backend | TTFT, cache on | TTFT, cache off | ratio |",
        "|---|---|---|---|",
    ]
    for backend in ("torch", "llamacpp"):
        on, off = med[f"{backend}, cache on"], med[f"{backend}, cache off"]
        lines.append(f"| {backend} | {1000 * on:.0f} ms | {1000 * off:.0f} ms | **{on / off:.3f}** |")
    lines += ["", "Every round (ms):", ""]
    lines += [f"- {k}: " + ", ".join(f"{1000 * x:.0f}" for x in v) for k, v in ttfts.items()]
    save_record(args.out, name, lines, {"machine": info, "ttft_s": ttfts, "median": med})


if __name__ == "__main__":
    main()
