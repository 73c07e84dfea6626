"""W4A16 GEMM (Triton, Marlin layout) vs torch fp16 on Llama-3-8B layer shapes: a markdown table and JSON.

Every timed call is replayed from a CUDA graph (as a decode step would be) over enough copies of the weights
that they do not fit in L2, so both sides stream their weights from HBM; the per-call time is the graph's time
over the number of calls. Before timing, the kernel is checked against the fp32 dequantize-then-matmul
reference. No network needed.

    .venv/bin/python bench/w4a16_gemm.py [--dtype fp16|bf16] [--m 1,2,4] [--shapes o,down] [--out r.json]
    .venv/bin/python bench/w4a16_gemm.py --sweep --shapes o --m 1,16,128   # search launch configs (slow)
    .venv/bin/python bench/w4a16_gemm.py --cpu-smoke   # no GPU: correctness under TRITON_INTERPRET=1
    .venv/bin/python bench/w4a16_gemm.py --cpu-bench   # the torch CPU kernels on SmolLM2-135M layer shapes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from quantserve.kernels.dispatch import KERNELS
from quantserve.kernels.marlin import MarlinWeight, to_marlin
from quantserve.kernels.qweight import QuantizedWeight
from quantserve.kernels.reference import relative_error, w4a16_reference
from quantserve.kernels.w4a16_triton import GemmConfig, TritonW4A16Kernel, marlin_dequantize, w4a16_gemm

LLAMA3_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SMOLLM2 = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576)}
SMOLLM2_PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}  # linears of each shape in one layer
M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 512)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
L2_FLUSH_BYTES = 256 << 20  # weight copies per timed graph until this many bytes: several times any L2


def random_marlin(k: int, n: int, group: int, device: str, dtype: torch.dtype, seed: int = 0) -> MarlinWeight:
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen, device=device) * 0.02 + 0.002).to(dtype)
    return to_marlin(QuantizedWeight(q, scales, None, 4, group))


def correctness(device: str, dtype: torch.dtype, cases: list[tuple[int, int, int]], group: int) -> list[dict]:
    """Relative error of every registered kernel that can run here vs the fp32 reference, on (K, N, M) cases."""
    rows = []
    for k, n, m in cases:
        mw = random_marlin(k, n, group, device, dtype)
        x = torch.randn(m, k, device=device).to(dtype)
        ref = w4a16_reference(x, mw).to(dtype)
        for cls in KERNELS:
            if not cls.can_implement(mw, dtype, device)[0]:
                continue
            kernel = cls()
            err = relative_error(kernel.apply(kernel.prepare(mw), x), ref)
            path = kernel.path(m) if isinstance(kernel, TritonW4A16Kernel) else "torch"
            tol = 3e-3 if dtype == torch.bfloat16 and path == "dequant+matmul" else 1e-3
            rows.append(
                {"kernel": cls.name, "K": k, "N": n, "M": m, "path": path, "rel_err": err, "ok": err < tol}
            )
    return rows


def graph_time_us(calls: list[Callable[[], object]], iters: int = 20, repeats: int = 5) -> float:
    """Median per-call time of `calls` captured back to back in one CUDA graph."""
    for call in calls:  # compile and autotune-free warm-up, outside the capture
        call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (iters * len(calls)))
    return statistics.median(samples)


def _dequant_mm(x: torch.Tensor, state) -> torch.Tensor:
    return x @ marlin_dequantize(state, x.dtype)


def copies_for(nbytes: int) -> int:
    return max(1, min(64, -(-L2_FLUSH_BYTES // nbytes)))


def sweep_configs(m: int) -> list[GemmConfig]:
    """A grid around the heuristic for --sweep (50-100 configs per M; each new one compiles once, ~1 s)."""
    out = []
    small = 1 << (m - 1).bit_length()
    tiles = (
        [(small, False), (16, True)]
        if m <= 4
        else [(b, True) for b in (16, 32, 64, 128) if 16 <= b <= max(16, 2 * m)]
    )
    for bm, use_dot in tiles:
        for bn in (64, 128, 256) if m <= 16 else (128, 256):
            for bk in (64, 128):
                for split in (1, 2, 4, 8, 16) if m <= 16 else (1, 2, 4) if m <= 64 else (1, 2):
                    for warps in (4, 8):
                        out.append(GemmConfig(bm, bn, bk, split, use_dot, warps, 4 if m <= 16 else 3))
    return out


def sweep(x: torch.Tensor, states: list, m: int) -> tuple[float, GemmConfig] | None:
    """Fastest config for this shape and M; configs that do not compile (shared memory) are skipped."""
    best = None
    for config in sweep_configs(m):
        try:
            us = graph_time_us([partial(w4a16_gemm, x, s, config=config) for s in states], 5, 3)
        except Exception as exc:  # noqa: BLE001 - a config the GPU cannot hold is just not a candidate
            print(f"  skip {config}: {type(exc).__name__}")
            continue
        if best is None or us < best[0]:
            best = (us, config)
    return best


def gpu_main(args: argparse.Namespace) -> dict:
    import triton

    dtype, device = DTYPES[args.dtype], "cuda"
    props = torch.cuda.get_device_properties(0)
    report = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "group_size": args.group,
        "timing": "CUDA graph replay, weights rotated past L2",
    }
    report["correctness"] = correctness(
        device, dtype, [(4096, 4096, m) for m in (1, 16, 128, 600)] + [(14336, 4096, 4)], args.group
    )
    for row in report["correctness"]:
        print(f"check {row['kernel']} K={row['K']} N={row['N']} M={row['M']} {row['path']}: "
              f"rel err {row['rel_err']:.2e} {'ok' if row['ok'] else 'FAIL'}")  # fmt: skip
    kernel = TritonW4A16Kernel(dequant_min_m=args.dequant_min_m)
    rows = []
    for name, (k, n) in ((s, LLAMA3_8B[s]) for s in args.shapes):
        w16 = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies_for(2 * k * n))]
        states = [
            kernel.prepare(random_marlin(k, n, args.group, device, dtype, s))
            for s in range(copies_for(k * n // 2))
        ]
        for m in args.m:
            x = torch.randn(m, k, device=device, dtype=dtype)
            row = {"shape": name, "K": k, "N": n, "M": m, "path": kernel.path(m)}
            row["dense_us"] = graph_time_us([partial(F.linear, x, w) for w in w16])
            row["w4a16_us"] = graph_time_us([partial(kernel.apply, s, x) for s in states])
            big = m >= 32  # where the fused-vs-dequant crossover can be
            row["fused_us"] = graph_time_us([partial(w4a16_gemm, x, s) for s in states]) if big else None
            row["dequant_mm_us"] = (
                graph_time_us([partial(_dequant_mm, x, s) for s in states]) if big else None
            )
            row["speedup"] = row["dense_us"] / row["w4a16_us"]
            best = sweep(x, states, m) if args.sweep and m < args.dequant_min_m else None
            if best is not None:
                row["sweep_best_us"], row["sweep_best_config"] = best[0], repr(best[1])
            rows.append(row)
            print(f"{name} M={m}: {args.dtype} {row['dense_us']:.1f} us, w4a16 {row['w4a16_us']:.1f} us "
                  f"({row['speedup']:.2f}x, {row['path']})", flush=True)  # fmt: skip
        del w16, states
        torch.cuda.empty_cache()
    report["rows"] = rows
    return report


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def markdown(report: dict) -> str:
    dt = report["dtype"]
    lines = [
        f"W4A16 GEMM on {report['device']} (torch {report['torch']}, triton {report['triton']}, "
        f"{dt} activations, group {report['group_size']}; {report['timing']})",
        "",
        f"| shape | K | N | M | torch {dt} us | w4a16 us | speedup | path | fused us | dequant+mm us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['shape']} | {r['K']} | {r['N']} | {r['M']} | {_num(r['dense_us'])} | {_num(r['w4a16_us'])} | "
            f"{r['speedup']:.2f}x | {r['path']} | {_num(r['fused_us'])} | {_num(r['dequant_mm_us'])} |"
        )
    if any("sweep_best_config" in r for r in report["rows"]):
        lines += ["", "| shape | M | best sweep us | config |", "|---|---|---|---|"]
        for r in report["rows"]:
            if "sweep_best_config" in r:
                lines.append(
                    f"| {r['shape']} | {r['M']} | {r['sweep_best_us']:.1f} | `{r['sweep_best_config']}` |"
                )
    return "\n".join(lines)


def cpu_smoke() -> dict:
    """The correctness part on a tiny shape, Triton interpreted: proves the script and the kernels run here."""
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first JIT-wrapped, i.e. below
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        rows += correctness("cpu", dtype, [(256, 128, 1), (256, 128, 16), (256, 128, 512)], group=64)
    for r in rows:
        print(f"{r['kernel']:>13} K={r['K']} N={r['N']} M={r['M']:>2} {r['path']:>10}: rel err {r['rel_err']:.2e} "
              f"{'ok' if r['ok'] else 'FAIL'}")  # fmt: skip
    return {"device": "cpu (TRITON_INTERPRET=1)", "correctness": rows}


def cpu_bench(threads: int, group: int = 64) -> dict:
    """Per-call ms of the torch CPU kernels on SmolLM2-135M's linears, and the per-token sum over 30 layers."""
    torch.set_num_threads(threads)
    rows, per_token = [], {}
    for name, (k, n) in SMOLLM2.items():
        mw = random_marlin(k, n, group, "cpu", torch.float32)
        for cls in (k for k in KERNELS if k.name.startswith("cpu_")):
            kernel = cls()
            state = kernel.prepare(mw)
            for m in (1, 64):
                x = torch.randn(m, k)
                for _ in range(5):
                    kernel.apply(state, x)
                samples = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    for _ in range(20):
                        kernel.apply(state, x)
                    samples.append((time.perf_counter() - t0) / 20 * 1e3)
                ms = min(samples)
                rows.append({"kernel": cls.name, "K": k, "N": n, "M": m, "ms": ms})
                print(f"{cls.name:>11} K={k:>4} N={n:>4} M={m:>2}: {ms:.3f} ms", flush=True)
                if m == 1:
                    per_token[cls.name] = per_token.get(cls.name, 0.0) + 30 * SMOLLM2_PER_LAYER[name] * ms
    for name, ms in per_token.items():
        print(
            f"{name}: {ms:.1f} ms of quantized linears per decoded token (30 layers, M=1, {threads} threads)"
        )
    return {"device": f"cpu, {threads} threads", "rows": rows, "per_token_ms": per_token}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="activation dtype (default fp16)")
    ap.add_argument(
        "--m", type=lambda s: [int(v) for v in s.split(",")], default=list(M_LIST), help="M values"
    )
    ap.add_argument(
        "--shapes",
        type=lambda s: s.split(","),
        default=list(LLAMA3_8B),
        help=f"Llama-3-8B layers to time, comma-separated (default all: {','.join(LLAMA3_8B)})",
    )
    ap.add_argument("--group", type=int, default=128, help="quantization group size (default 128)")
    ap.add_argument(
        "--dequant-min-m", type=int, default=512, help="M from which apply() dequantizes + cuBLAS"
    )
    ap.add_argument("--sweep", action="store_true", help="also search launch configs per shape and M (slow)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="no GPU: check correctness under TRITON_INTERPRET=1"
    )
    ap.add_argument("--cpu-bench", action="store_true", help="time the CPU kernels on SmolLM2-135M shapes")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads for --cpu-bench (default 2)")
    args = ap.parse_args(argv)
    if unknown := set(args.shapes) - set(LLAMA3_8B):
        ap.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(LLAMA3_8B)}")
    if args.cpu_smoke:
        report = cpu_smoke()
        ok = all(r["ok"] for r in report["correctness"])
    elif args.cpu_bench:
        report, ok = cpu_bench(args.threads), True
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU here; use --cpu-smoke (correctness) or --cpu-bench (CPU kernels)")
        report = gpu_main(args)
        ok = all(r["ok"] for r in report["correctness"])
        print(markdown(report))
    report["host"] = platform.node()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
