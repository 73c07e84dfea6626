"""Serving benchmark: quantserve vs llama-cpp-python's server (and llama.cpp's llama-server), one at a time.

Usage: .venv/bin/python bench/serving.py [--quick] [--rounds 3] [--threads 2] [--llama-server PATH]
Writes bench/results/serving-<date>.md and .json.

A shared VM's speed drifts by several percent from minute to minute, so every server is measured in each of
--rounds rounds (servers in turn, alone on the machine), and each level reports its median round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: import the quantserve beside it

# serving_report.py is beside this script, in sys.path[0]
from serving_report import QUANTSERVE, write_report  # noqa: E402

from quantserve import __version__ as quantserve_version  # noqa: E402
from quantserve.cli.loadgen import (  # noqa: E402
    DEFAULT_PROMPTS,
    LoadSpec,
    ServerUnreachableError,
    run_load,
    wait_ready,
)
from quantserve.cli.loadgen_report import LoadResult  # noqa: E402
from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

LCPP, NATIVE = "llama-cpp-python", "llama-server"
QUANTSERVE_UNIFIED = "quantserve-kv-unified"


@dataclass(frozen=True)
class ServerDef:
    name: str
    cmd: tuple[str, ...]
    port: int
    ignore_eos: bool  # False: the server ignores the field, so outputs may end early (tokens are counted)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_defs(gguf: Path, threads: int, n_ctx: int, seqs: int, native: Path | None) -> list[ServerDef]:
    t, py = str(threads), sys.executable
    defs = []
    p = free_port()
    defs.append(
        ServerDef(
            QUANTSERVE,
            # quantserve gives every sequence its own KV cells; n_ctx / seqs each is what llama-server -np gives its
            # slots from the same -c, so both hold the same KV memory.
            (py, "-m", "quantserve.cli", "run", str(gguf), "--threads", t, "--max-num-seqs", str(seqs))
            + ("--ctx-size", str(n_ctx // seqs), "--port", str(p), "--log-level", "warning"),
            p,
            ignore_eos=True,
        )
    )
    p = free_port()
    defs.append(
        ServerDef(
            QUANTSERVE_UNIFIED,
            # one shared pool of n_ctx cells, as llama-server's -c: more throughput, outputs depend on batching
            (py, "-m", "quantserve.cli", "run", str(gguf), "--threads", t, "--max-num-seqs", str(seqs))
            + ("--kv-unified", "--kv-size", str(n_ctx), "--ctx-size", str(n_ctx // seqs))
            + ("--port", str(p), "--log-level", "warning"),
            p,
            ignore_eos=True,
        )
    )
    p = free_port()
    defs.append(
        ServerDef(
            LCPP,
            (py, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", t, "--n_threads_batch", t)
            + ("--n_ctx", str(n_ctx), "--port", str(p), "--interrupt_requests", "False"),
            p,
            ignore_eos=False,
        )
    )
    if native is not None:
        p = free_port()
        # -np slots share -c: 8192 / 8 = 1024 tokens per slot, plenty for these prompts + 128 tokens.
        defs.append(
            ServerDef(
                NATIVE,
                (str(native), "-m", str(gguf), "-np", str(seqs), "-t", t, "-tb", t, "-c", str(n_ctx))
                + ("--host", "127.0.0.1", "--port", str(p)),
                p,
                ignore_eos=True,
            )
        )
    return defs


def start(sd: ServerDef, log_path: Path) -> subprocess.Popen:
    """Start a server in its own session: Ctrl-C reaches only us, and `stop` ends the server and its helpers."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            sd.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )


def wait_serving(sd: ServerDef, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{sd.name} exited with {proc.returncode}; see {log_path}")
        try:
            asyncio.run(wait_ready(f"http://127.0.0.1:{sd.port}", timeout=1.0))
            return
        except ServerUnreachableError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sd.name} not ready after {timeout:.0f} s; see {log_path}") from None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # start_new_session made the server's pid its group id
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def save_record(out: Path, name: str, lines: list[str], data: dict) -> None:
    """A benchmark's record: bench/results/NAME.md (the report, also printed) and NAME.json (the raw numbers)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))


def machine_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")),
        platform.processor(),
    )
    mem_kb = next(
        (
            int(ln.split()[1])
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemTotal")
        ),
        0,
    )
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo if ln.startswith("flags")), [])
    return {
        "cpu": cpu,
        "isa": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags],
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions(native: Path | None) -> dict:
    v = {"quantserve": quantserve_version, "llama-cpp-python": version("llama-cpp-python")}
    git = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    v["quantserve_git"] = git.stdout.strip() or None
    if native is not None:
        out = subprocess.run([str(native), "--version"], capture_output=True, text=True, timeout=30)
        v["llama-server"] = next(
            (ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln), "?"
        )
    return v


@dataclass(frozen=True)
class Load:
    levels: dict[int, int]  # concurrency -> requests
    max_tokens: int
    ready_timeout: float


def measure(
    defs: list[ServerDef], load: Load, rounds: int
) -> tuple[list[dict[str, list[LoadResult]]], dict[str, str], Path]:
    """`rounds` times, each server in turn, alone on the machine: start, load it at every level, stop (also on
    Ctrl-C). A server that will not start is dropped from later rounds.

    Returns each round's results, the servers that would not start (name → message naming its log), the log folder.
    """
    all_runs: list[dict[str, list[LoadResult]]] = []
    failed: dict[str, str] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="qs-serving-"))
    for k in range(rounds):
        print(f"== round {k + 1}/{rounds}", file=sys.stderr)
        live = [sd for sd in defs if sd.name not in failed]
        all_runs.append(measure_round(live, load, log_dir, k, failed))
    return all_runs, failed, log_dir


def measure_round(
    defs: list[ServerDef], load: Load, log_dir: Path, k: int, failed: dict[str, str]
) -> dict[str, list[LoadResult]]:
    runs: dict[str, list[LoadResult]] = {}
    for sd in defs:
        print(f"== {sd.name}: {shlex.join(sd.cmd)}", file=sys.stderr)
        log_path = log_dir / f"{sd.name}-{k + 1}.log"
        proc = start(sd, log_path)
        try:
            try:
                wait_serving(sd, proc, log_path, load.ready_timeout)
            except RuntimeError as exc:  # one server that will not start should not cost the others' numbers
                print(f"error: {exc}", file=sys.stderr)
                failed[sd.name] = str(exc)
                continue
            runs[sd.name] = []
            for c, n in load.levels.items():
                spec = LoadSpec(
                    base_url=f"http://127.0.0.1:{sd.port}",
                    concurrency=c,
                    num_requests=n,
                    prompts=DEFAULT_PROMPTS,
                    max_tokens=load.max_tokens,
                    ignore_eos=sd.ignore_eos,
                    warmup=1,
                    # "[c8.12] ...": no prompt repeats within a server's life, so no server answers one from its
                    # prompt cache (llama-server keeps whole prompts in RAM; an earlier level's would hit it).
                    tag=f"c{c}",
                )
                r = asyncio.run(run_load(spec))
                print(f"   c={c}: {r.agg_tok_s:.1f} tok/s, {r.num_errors} errors", file=sys.stderr)
                runs[sd.name].append(r)
        finally:
            stop(proc)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="models.toml name or GGUF path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128 (32 with --quick)")
    ap.add_argument("--num-requests", type=int, default=None, help="per level; default max(8, 4 x conc.)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument(
        "--llama-server", type=Path, default=None, help="default: bench/.build/llama-server if built"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        choices=[QUANTSERVE, QUANTSERVE_UNIFIED, LCPP, NATIVE],
        help="measure only these servers",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: few requests, 32 tokens, 1 round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds over all servers (default 3; 1 with --quick); each cell reports the median round",
    )
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()

    if args.llama_server is not None and not args.llama_server.is_file():
        ap.error(
            f"--llama-server {args.llama_server} does not exist; build it with bench/build_llama_server.sh"
        )
    native = args.llama_server or ROOT / "bench/.build/llama-server"
    if not native.is_file():
        print(
            f"note: no {native} (bench/build_llama_server.sh builds it): skipping llama-server",
            file=sys.stderr,
        )
        native = None
    gguf = resolve(args.model, load_registry(find_models_toml(ROOT / "models.toml"))).path
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    levels = {c: args.num_requests or (max(2, c) if args.quick else max(8, 4 * c)) for c in args.concurrency}
    defs = server_defs(gguf, args.threads, args.n_ctx, args.max_num_seqs, native)
    defs = [d for d in defs if not args.only or d.name in args.only]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server on SIGTERM too

    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        ap.error("--rounds must be at least 1")
    all_runs, failed, log_dir = measure(defs, Load(levels, max_tokens, args.ready_timeout), rounds)
    if not all_runs[0]:
        return 1

    now = dt.datetime.now()
    base = f"serving-{now:%Y-%m-%d}{'-quick' if args.quick else ''}"
    stem, k = args.out_dir / base, 1
    while stem.with_suffix(".md").exists():  # never overwrite an earlier run of the same day
        k += 1
        stem = args.out_dir / f"{base}-{k}"
    info = {
        "date": now.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": {"path": str(gguf), "size_bytes": gguf.stat().st_size},
        "versions": versions(native if NATIVE in all_runs[0] else None),
        "settings": {
            "threads": args.threads,
            "concurrency": args.concurrency,
            "num_requests": levels,
            "max_tokens": max_tokens,
            "stream": True,
            "endpoint": "chat",
            "temperature": 0.0,
            "warmup": 1,
            "n_ctx": args.n_ctx,
            "max_num_seqs": args.max_num_seqs,
            "quick": args.quick,
            "rounds": rounds,
        },
        "command": shlex.join([sys.executable, *sys.argv]),
        "servers": {sd.name: {"cmd": shlex.join(sd.cmd), "ignore_eos": sd.ignore_eos} for sd in defs},
        "failed": failed,
    }
    write_report(stem, info, all_runs)
    print(f"wrote {stem.with_suffix('.md')} and .json (server logs in {log_dir})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the servers are already stopped by measure()'s finally
        print("interrupted", file=sys.stderr)
        sys.exit(130)
