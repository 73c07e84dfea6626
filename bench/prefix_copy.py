"""What copying a cached prefix between llama.cpp slots saves (quantserve.engine.kv.slots, CopyKV): the same
work with the copy on and off (MIN_COPY_GAIN out of reach: each slot computes the prefix itself), in one process,
alternating, on SmolLM2 Q4_1 with 8 slots.

Usage: .venv/bin/python bench/prefix_copy.py [--rounds 3] [--threads 2]
Writes bench/results/prefix-copy-<date>.md and .json.

Two workloads, each after one request that leaves the shared prefix in one slot's cache:
- rerank: 16 documents judged yes/no in one request (quantserve.rerank.judge: the instruction and the query are
  the shared prefix, about 75 tokens);
- chats: 8 chats sent at once that share a system prompt of about 400 tokens, one token generated each (so the
  time is the prefill's).
Each measurement has a tag of its own at the start of its query or system prompt. In the rerank workload the tag
sits after the judge's system prompt and instruction, which every slot already holds from earlier requests: only
the query part of the prefix (about 30 tokens, near MIN_COPY_GAIN) is left to share, as with a real stream of
rerank requests, so the copy saves little there; the chats share their whole 400-token prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving import machine_info, save_record, versions  # noqa: E402

import quantserve.engine.kv.slots as slots  # noqa: E402
from quantserve.llm import load  # noqa: E402
from quantserve.rerank import judge  # noqa: E402

DOCS = [
    f"Document {i}: the river crosses the old town under {i + 2} stone bridges near the museum."
    for i in range(16)
]
SYSTEM = " ".join(
    f"Rule {i}: answer briefly, politely and only with facts you are sure of." for i in range(30)
)
COPY_GAIN = slots.MIN_COPY_GAIN


def rerank_once(llm, tag: str) -> float:
    asyncio.run(judge(llm, f"{tag} Which document mentions bridges?", DOCS[:1]))  # leaves the prefix cached
    t = time.perf_counter()
    asyncio.run(judge(llm, f"{tag} Which document mentions bridges?", DOCS))
    return time.perf_counter() - t


def chats_once(llm, tag: str) -> float:
    system = f"{tag} {SYSTEM}"

    async def one(i: int) -> None:
        async for _ in llm.chat(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
            ],
            max_tokens=1,
            temperature=0.0,
        ):
            pass

    asyncio.run(one(-1))  # leaves the system prompt cached

    async def together() -> None:
        await asyncio.gather(*(one(i) for i in range(8)))

    t = time.perf_counter()
    asyncio.run(together())
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    llm = load("smollm2", max_num_seqs=8, ctx_size=2048, threads=args.threads)
    rows: dict[str, dict[str, list[float]]] = {
        "rerank": {"copy": [], "no copy": []},
        "chats": {"copy": [], "no copy": []},
    }
    try:
        for rnd in range(args.rounds):
            order = ("copy", "no copy") if rnd % 2 == 0 else ("no copy", "copy")
            for work, fn in (("rerank", rerank_once), ("chats", chats_once)):
                for mode in order:
                    slots.MIN_COPY_GAIN = COPY_GAIN if mode == "copy" else 10**9
                    # a fresh tag per measurement: nothing of it is cached from before
                    rows[work][mode].append(fn(llm, f"[{rnd}:{mode}]"))
                    print(f"round {rnd} {work:6s} {mode:7s} {rows[work][mode][-1]:.2f} s", flush=True)
    finally:
        slots.MIN_COPY_GAIN = COPY_GAIN
        llm.close()
    stamp = dt.datetime.now(dt.UTC)
    info = machine_info()
    lines = [
        "# Copying a cached prefix between llama.cpp slots, on and off",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/prefix_copy.py --rounds "
        f"{args.rounds} --threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(None).items()),
        "",
        "SmolLM2-135M-Instruct Q4_1 on the llama.cpp backend, in process (quantserve.llm), 8 slots, ctx 2048, "
        f"per-sequence KV. Off: MIN_COPY_GAIN out of reach, so each slot computes the shared prefix itself (as "
        f"before CopyKV). On: the default ({COPY_GAIN} tokens). Median of the rounds; the modes alternate which "
        "goes first. The rerank workload's documents share only their query (about 30 tokens) beyond what every "
        "slot already holds from earlier requests (the judge's system prompt and instruction), so the copy saves "
        "little there; the chats share a whole 400-token system prompt.",
        "",
        "| workload | copy on | copy off | ratio (on / off) |",
        "|---|---|---|---|",
    ]
    medians = {}
    for work, modes in rows.items():
        on, off = statistics.median(modes["copy"]), statistics.median(modes["no copy"])
        medians[work] = {"copy_s": on, "no_copy_s": off, "ratio": on / off}
        what = (
            "16 documents, one /v1/rerank-style judge call"
            if work == "rerank"
            else "8 chats at once, 1 token"
        )
        lines.append(f"| {what} | {on:.2f} s | {off:.2f} s | **{on / off:.3f}** |")
    lines += ["", "Every round (on s, off s):", ""]
    lines += [
        f"- {w}: " + "; ".join(f"{a:.2f}, {b:.2f}" for a, b in zip(m["copy"], m["no copy"], strict=True))
        for w, m in rows.items()
    ]
    save_record(
        args.out, f"prefix-copy-{stamp:%Y-%m-%d}", lines, {"machine": info, "rounds": rows, "median": medians}
    )


if __name__ == "__main__":
    main()
