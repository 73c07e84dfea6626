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
from quantserve.kernels.w4a16_plain import PlainConfig, plain_dequantize, plain_gemm
from quantserve.kernels.w4a16_triton import TritonW4A16Kernel, prepare_marlin, w4a16_gemm

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
    return event_median_ms(graph.replay, iters, repeats) * 1e3 / len(calls)


def event_median_ms(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Median over `repeats` of the per-call ms of `iters` calls of fn back to back, timed by CUDA events."""
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def _plain_dequant_mm(x: torch.Tensor, state) -> torch.Tensor:
    w = plain_dequantize(state, x.dtype)
    return (x if state.perm is None else x[:, state.perm]) @ w


def tinygemm_weight(q: torch.Tensor, scales: torch.Tensor, group: int, inner_k_tiles: int = 8):
    """torch's int4 weight-only operands (`_weight_int4pack_mm`, tinygemm) for the same symmetric weight as
    ours: W[k, n] = (q[k, n] - 8) * scales[k // group, n], q in [0, 15]. tinygemm's dequantization is
    (q - 8) * scale + zero, so zero = 0 (torchao's pack_tinygemm_scales_and_zeros layout: [K/G, N, 2])."""
    qt = q.t().contiguous().to(torch.int32)  # [N, K]
    packed = ((qt[:, ::2] << 4) | qt[:, 1::2]).to(torch.uint8)
    w = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
    sz = torch.stack([scales.to(torch.bfloat16), torch.zeros_like(scales, dtype=torch.bfloat16)], dim=-1)
    return w, sz.contiguous()


def tinygemm_check(device: str) -> dict:
    """tinygemm against the fp32 reference on our weight: proves the operands above mean the same weight."""
    k, n, group = 4096, 4096, 128
    gen = torch.Generator(device=device).manual_seed(5)
    q = torch.randint(0, 16, (k, n), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen, device=device) * 0.02 + 0.002).to(torch.bfloat16)
    x = torch.randn(16, k, device=device, dtype=torch.bfloat16)
    w, sz = tinygemm_weight(q, scales, group)
    out = torch.ops.aten._weight_int4pack_mm(x, w, group, sz)
    mw = to_marlin(QuantizedWeight(q, scales, None, 4, group))
    err = relative_error(out, w4a16_reference(x, mw).to(torch.bfloat16))
    return {"rel_err": err, "ok": err < 1e-2}


def copies_for(nbytes: int) -> int:
    return max(1, min(64, -(-L2_FLUSH_BYTES // nbytes)))


def sweep_configs(m: int) -> list[PlainConfig]:
    """A grid around the K-packed kernel's heuristic for --sweep (each new config compiles once, ~1 s)."""
    out = []
    tiles = (
        [(1, False), (16, True)]
        if m == 1
        else [(b, True) for b in (16, 32, 64, 128) if 16 <= b <= max(16, 2 * m)]
    )
    for bm, use_dot in tiles:
        for bn in (64, 128, 256):
            for bk in (64, 128):
                for split in (1, 2, 4, 8) if m <= 16 else (1, 2) if m <= 64 else (1,):
                    for warps in (4, 8):
                        out.append(PlainConfig(bm, bn, bk, split, use_dot, warps, 4 if m <= 16 else 3))
    return out


def sweep(
    x: torch.Tensor, states: list, m: int, deadline: float = float("inf")
) -> tuple[float, PlainConfig] | None:
    """Fastest config of the K-packed kernel for this shape and M; configs that do not compile (shared memory)
    are skipped; stops at `deadline` (time.perf_counter) with the best so far."""
    best = None
    for config in sweep_configs(m):
        if time.perf_counter() > deadline:
            break
        try:
            us = graph_time_us([partial(plain_gemm, x, s, config=config) for s in states], 5, 3)
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
    tiny = None
    if args.tinygemm:
        try:
            report["tinygemm_check"] = tinygemm_check(device)
            tiny = True  # timed even if the check fails: the same bytes move; the report shows the check
            print(f"tinygemm check: rel err {report['tinygemm_check']['rel_err']:.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a torch without the op: the table says so
            report["tinygemm_check"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"tinygemm unavailable: {exc}", flush=True)
    rows = []
    sweep_left = args.sweep_budget
    for name, (k, n) in ((s, LLAMA3_8B[s]) for s in args.shapes):
        w16 = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies_for(2 * k * n))]
        other = torch.bfloat16 if dtype == torch.float16 else torch.float16
        w16b = [w.to(other) for w in w16] if args.both_dtypes else []
        mws = [random_marlin(k, n, args.group, device, dtype, s) for s in range(copies_for(k * n // 2))]
        states = [kernel.prepare(mw) for mw in mws]  # the K-packed copies (w4a16_plain.py)
        marlin_states = [prepare_marlin(mw) for mw in mws] if args.marlin else []
        tg = []
        if tiny:
            for s in range(copies_for(k * n // 2)):
                g = torch.Generator(device=device).manual_seed(s)
                q = torch.randint(0, 16, (k, n), generator=g, device=device, dtype=torch.uint8)
                tg.append(
                    tinygemm_weight(q, torch.rand(k // args.group, n, device=device) * 0.02, args.group)
                )
        for m in args.m:
            x = torch.randn(m, k, device=device, dtype=dtype)
            row = {"shape": name, "K": k, "N": n, "M": m, "path": kernel.path(m, states[0])}
            row["dense_us"] = graph_time_us([partial(F.linear, x, w) for w in w16])
            if w16b:
                xb = x.to(other)
                row[f"dense_{'bf16' if other == torch.bfloat16 else 'fp16'}_us"] = graph_time_us(
                    [partial(F.linear, xb, w) for w in w16b]
                )
            row["w4a16_us"] = graph_time_us([partial(kernel.apply, s, x) for s in states])
            if marlin_states and m < args.dequant_min_m:  # the Marlin-layout kernel, for comparison
                row["marlin_us"] = graph_time_us([partial(w4a16_gemm, x, s) for s in marlin_states])
            if tg:
                xb = x.to(torch.bfloat16)
                row["tinygemm_us"] = graph_time_us(
                    [partial(torch.ops.aten._weight_int4pack_mm, xb, w, args.group, sz) for w, sz in tg]
                )
            big = m >= 32  # where the fused-vs-dequant crossover can be
            sms = props.multi_processor_count
            row["fused_us"] = (
                graph_time_us([partial(plain_gemm, x, s, sm_count=sms) for s in states]) if big else None
            )
            row["dequant_mm_us"] = (
                graph_time_us([partial(_plain_dequant_mm, x, s) for s in states]) if big else None
            )
            row["speedup"] = row["dense_us"] / row["w4a16_us"]
            best = None
            if m in args.sweep_m and m < args.dequant_min_m and sweep_left > 0:
                t0 = time.perf_counter()
                best = sweep(x, states, m, deadline=t0 + sweep_left)
                sweep_left -= time.perf_counter() - t0
            if best is not None:  # the winner must also be right
                err = relative_error(
                    plain_gemm(x, states[0], config=best[1]), w4a16_reference(x, mws[0]).to(dtype)
                )
                row["sweep_best_us"], row["sweep_best_config"] = best[0], repr(best[1])
                row["sweep_best_rel_err"] = err
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
        f"| shape | K | N | M | torch {dt} us | w4a16 us | speedup | path | fused us | dequant+mm us | tinygemm us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['shape']} | {r['K']} | {r['N']} | {r['M']} | {_num(r['dense_us'])} | {_num(r['w4a16_us'])} | "
            f"{r['speedup']:.2f}x | {r['path']} | {_num(r['fused_us'])} | {_num(r['dequant_mm_us'])} | "
            f"{_num(r.get('tinygemm_us'))} |"
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


def parser() -> argparse.ArgumentParser:
    """The command line (tests/bench/test_gpu_script.py parses bench/gpu/run.py's commands with it)."""
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
        "--dequant-min-m",
        type=int,
        default=128,
        help="M from which apply() dequantizes + cuBLAS (default 128)",
    )
    ap.add_argument("--sweep", action="store_true", help="also search launch configs per shape and M (slow)")
    ap.add_argument(
        "--sweep-m",
        type=lambda s: [int(v) for v in s.split(",")],
        default=None,
        help="search launch configs at these M only (default: every M with --sweep, none without)",
    )
    ap.add_argument("--sweep-budget", type=float, default=float("inf"), help="seconds of searching in all")
    ap.add_argument(
        "--tinygemm", action="store_true", help="also time torch's int4 kernel (bf16 activations)"
    )
    ap.add_argument(
        "--both-dtypes", action="store_true", help="also time the dense GEMM in the other half type"
    )
    ap.add_argument(
        "--marlin", action="store_true", help="also time the Marlin-layout Triton kernel (w4a16_jit.py)"
    )
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="no GPU: check correctness under TRITON_INTERPRET=1"
    )
    ap.add_argument("--cpu-bench", action="store_true", help="time the CPU kernels on SmolLM2-135M shapes")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads for --cpu-bench (default 2)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.sweep_m is None:
        args.sweep_m = args.m if args.sweep else []
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
