"""A backend's serving speed before and after a change: SmolLM2 on the CPU under `quantserve run --backend torch`
(its fp32 HF checkpoint) or `--backend llamacpp` (its Q4_1 GGUF), tokens/s at 1 and 8 concurrent streams, a baseline
commit and this tree measured in turn, in one run.

Usage: .venv/bin/python bench/torch_step.py --baseline REV [--backend torch|llamacpp] [--rounds 3] [--max-tokens 64]
    [--threads 2]
Writes bench/results/<backend>-step-<date>.md and .json.

Each tree is installed (pip --target, no dependencies) into bench/.build, so that a server runs that tree's
quantserve only; each round starts each tree's server alone on the machine, loads it at every level (streaming chat,
greedy, ignore_eos, distinct prompts), and stops it. Each cell is the median round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from constrained import hf_checkpoint  # noqa: E402
from serving import ServerDef, free_port, machine_info, save_record, stop, versions, wait_serving  # noqa: E402

from quantserve.cli.loadgen import LoadSpec, run_load  # noqa: E402
from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

BUILD = ROOT / "bench/.build"


def install(rev: str | None) -> tuple[str, Path]:
    """(name, site dir) of a tree installed on its own: `rev` checked out into a worktree, or this tree."""
    if rev is None:
        name, src = "this tree", ROOT
    else:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
        name, src = f"baseline {sha}", BUILD / f"worktree-{sha}"
        if not src.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(src), sha], check=True)
    site = BUILD / f"site-{name.replace(' ', '-')}"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--upgrade",
         "--target", str(site), str(src)],
        check=True,
    )  # fmt: skip
    return name, site


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--baseline", required=True, help="the commit to compare with (e.g. the one before a change)"
    )
    ap.add_argument("--backend", choices=("torch", "llamacpp"), default="torch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    gguf = resolve("smollm2", load_registry(find_models_toml(None))).path
    model = hf_checkpoint(gguf) if args.backend == "torch" else gguf
    trees = [install(args.baseline), install(None)]
    results: dict[str, dict[int, list[dict]]] = {name: {lv: [] for lv in levels} for name, _ in trees}
    logs = Path(tempfile.mkdtemp(prefix="qs-torch-step-"))
    for rnd in range(args.rounds):
        for name, site in trees:
            port = free_port()
            cmd = (sys.executable, "-m", "quantserve.cli", "run", str(model), "--backend", args.backend, "--threads",
                   str(args.threads), "--max-num-seqs", str(max(levels)), "--ctx-size", "1024", "--port", str(port),
                   "--log-level", "warning")  # fmt: skip
            sd = ServerDef(name, cmd, port, ignore_eos=True)
            log = logs / f"{name.replace(' ', '-')}-{rnd}.log"
            env = {**os.environ, "PYTHONPATH": str(site)}
            proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                    env=env, start_new_session=True)  # fmt: skip
            try:
                wait_serving(sd, proc, log, 300)
                for lv in levels:
                    spec = LoadSpec(f"http://127.0.0.1:{port}", concurrency=lv, num_requests=4 * lv,
                                    max_tokens=args.max_tokens, warmup=1, tag=f"{rnd}.{lv}")  # fmt: skip
                    r = asyncio.run(run_load(spec))
                    if r.num_errors:
                        raise RuntimeError(f"{name}: {r.errors[:3]}")
                    results[name][lv].append({"tok_s": r.agg_tok_s, "tpot_ms": r.tpot_p50_ms})
                    print(f"round {rnd} {name:22s} {lv} streams: {r.agg_tok_s:7.1f} tok/s", flush=True)
            finally:
                stop(proc)
    write(args, trees, levels, results)


def write(args, trees, levels, results) -> None:
    stamp = dt.datetime.now(dt.UTC)
    name = f"{args.backend}-step-{stamp:%Y-%m-%d}"
    med = {
        t: {lv: statistics.median(r["tok_s"] for r in rs) for lv, rs in by.items()}
        for t, by in results.items()
    }
    (base, _), (cur, _) = trees
    info = machine_info()
    lines = [
        f"# The {args.backend} backend's serving speed, before and after",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/torch_step.py --baseline "
        f"{args.baseline} --backend {args.backend} --rounds {args.rounds} --max-tokens {args.max_tokens} "
        f"--threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(None).items()),
        "",
        "SmolLM2-135M-Instruct, "
        + ("fp32 HF checkpoint (our GGUF -> HF converter)" if args.backend == "torch" else "Q4_1 GGUF")
        + f", `quantserve run --backend {args.backend} --threads {args.threads}` on the CPU; streaming chat, greedy, "
        f"{args.max_tokens} tokens each (ignore_eos), "
        "4 requests per stream, distinct prompts. Each cell: median of the rounds (trees in turn, alone).",
        "",
        f"| streams | {base} tok/s | {cur} tok/s | ratio |",
        "|---|---|---|---|",
    ]
    for lv in levels:
        lines.append(
            f"| {lv} | {med[base][lv]:.1f} | {med[cur][lv]:.1f} | **{med[cur][lv] / med[base][lv]:.3f}** |"
        )
    lines += ["", "Every round (tok/s):", ""]
    for t, by in results.items():
        for lv, rs in by.items():
            lines.append(f"- {t}, {lv} streams: " + ", ".join(f"{r['tok_s']:.1f}" for r in rs))
    save_record(args.out, name, lines, {"machine": info, "results": results, "median": med})


if __name__ == "__main__":
    main()
