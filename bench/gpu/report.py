"""The markdown report of a bench/gpu/run.py run: what ran where, each step's outcome, and the numbers against the
targets of issue 30 (on an H100 or H200)."""

from __future__ import annotations

LARGE_8B = ("gate_up", "down")  # "the large 8B shapes"
TARGETS = {
    "gemm_small_m": 3.0,  # W4A16 over fp16, M <= 16, large shapes (Marlin: 3.87x of an ideal 4x)
    "gemm_vs_tinygemm_m1": 1.0,
    "gemm_large_m": 0.9,  # never below this at M >= 128
    "decode_b1": 250.0,  # tok/s, 8B shape, 4-bit (torchao: 241 with torch.compile on an H100)
    "decode_b16": 2400.0,  # tok/s (GemLite ~2,400, vLLM Marlin ~2,200)
}


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def render(results: dict) -> str:
    steps = {s["step"]: s for s in results["steps"]}
    env = steps.get("env", {}).get("result", {})
    dev = env.get("device", {})
    lines = [
        f"# GPU run ({results['mode']}), {results['started']}",
        "",
        f"- device: {dev.get('name', '?')} (capability {dev.get('capability', '-')}, {dev.get('sm_count', '-')} SMs, "
        f"{dev.get('memory_gib', '-')} GiB); nvidia-smi: {env.get('nvidia_smi', '-')}",
        f"- python {env.get('python', results['python'])}, "
        + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
        + f"; llama.cpp: {env.get('llama_cpp', '?')}",
        f"- host {results['host']}, whole run {results.get('wall_s', '-')} s",
        "",
        "| step | outcome | wall s |",
        "|---|---|---|",
    ]
    for s in results["steps"]:
        outcome = "ok" if s["ok"] else ("timed out" if s["timed_out"] else f"failed (rc {s['rc']})")
        if s.get("error"):
            outcome += f": {s['error']}"
        lines.append(f"| {s['step']} | {outcome} | {s['wall_s']} |")
    if "cuda-tests" in steps:
        lines += ["", "## CUDA tests", "", _tests(steps["cuda-tests"].get("result", {}))]
    if (r := steps.get("gemm", {}).get("result")) and r.get("rows"):
        lines += ["", "## W4A16 GEMM", "", *_gemm(r)]
    if r := steps.get("moe-layer", {}).get("result"):
        lines += ["", "## MoE layer (grouped W4A16)", "", r.get("markdown", "no table")]
    if r := steps.get("oss-moe", {}).get("result"):
        lines += ["", "## gpt-oss MoE layer (grouped MXFP4)", "", r.get("markdown", "no table")]
    if r := steps.get("fp8-gemm", {}).get("result"):
        lines += ["", "## FP8 linears (W8A16)", "", r.get("markdown", "no table")]
    if r := steps.get("moe-decode", {}).get("result"):
        lines += ["", "## MoE decode", "", *_decode(r)]
    if (r := steps.get("gemm-sweep", {}).get("result")) and r.get("rows"):
        lines += ["", "## W4A16 launch-config sweep", "", *_gemm(r)]
    elif r:
        bad = [c for c in r.get("correctness", []) if not c["ok"]]
        lines += ["", "## W4A16 GEMM", "", f"correctness only ({r.get('device')}): "
                  f"{len(r.get('correctness', [])) - len(bad)} checks ok, {len(bad)} failed"]  # fmt: skip
    if r := steps.get("decode", {}).get("result"):
        lines += ["", "## Decode", "", *_decode(r)]
    if (r := steps.get("deltanet", {}).get("result")) and r.get("rows"):
        lines += [
            "",
            f"## Gated DeltaNet kernels ({r.get('device')})",
            "",
            "| step | size | PyTorch ms | kernel ms | PyTorch / kernel | rel err |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {x['what']} | {x.get('batch', x.get('tokens'))} | {_f(x['torch_ms'], '.3f')} | "
                  f"{_f(x['kernel_ms'], '.3f')} | {_f(x['ratio'], '.2f')} | {x['rel_err']:.1e} |" for x in r["rows"]]  # fmt: skip
    if r := steps.get("serve", {}).get("result"):
        lines += ["", "## Serving smoke test", "", *_serve(r)]
    failed = [s for s in results["steps"] if not s["ok"]]
    if failed:
        lines += ["", "## Log tails of failed steps"]
        for s in failed:
            lines += ["", f"### {s['step']}", "", "```", *s.get("log_tail", []), "```"]
    return "\n".join(lines) + "\n"


def _tests(c: dict) -> str:
    if "error" in c:
        return c["error"]
    text = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped" + (
        f" ({c['note']})" if c.get("note") else ""
    )
    if c["failures"]:
        text += "\n\nFailed:\n" + "\n".join(f"- `{name}`" for name in c["failures"])
    return text


def _gemm(r: dict) -> list[str]:
    dt = r.get("dtype", "fp16")
    bad = [c for c in r.get("correctness", []) if not c["ok"]]
    out = [
        f"{r['device']}, torch {r['torch']}, triton {r['triton']}, {dt} activations, group {r['group_size']}; "
        f"{r['timing']}. Correctness against the fp32 dequantize-then-matmul reference: "
        f"{len(r['correctness']) - len(bad)} ok, {len(bad)} failed.",
        "",
        f"| shape | M | {dt} us | w4a16 us | vs {dt} | tinygemm us | vs tinygemm | path | Marlin-layout kernel us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    small, m1, large = [], [], []
    for row in r["rows"]:
        tg = row.get("tinygemm_us")
        vs_tg = tg / row["w4a16_us"] if tg else None
        out.append(
            f"| {row['shape']} | {row['M']} | {_f(row['dense_us'])} | {_f(row['w4a16_us'])} | "
            f"{row['speedup']:.2f}x | {_f(tg)} | {_f(vs_tg, '.2f')} | {row['path']} | {_f(row.get('marlin_us'))} |"
        )
        if row["M"] <= 16 and row["shape"] in LARGE_8B:
            small.append(row["speedup"])
        if row["M"] == 1 and vs_tg is not None:
            m1.append(vs_tg)
        if row["M"] >= 128:
            large.append(row["speedup"])
    if tc := r.get("tinygemm_check"):
        out += ["", "tinygemm (bf16 activations, same 4-bit weight) against the fp32 reference: "
                + (tc["error"] if "error" in tc else f"rel err {tc['rel_err']:.2e} ({'ok' if tc['ok'] else 'FAILED'})")]  # fmt: skip
    out += ["", "| target | measured | |", "|---|---|---|"]
    t = TARGETS
    if small:
        out.append(f"| >= {t['gemm_small_m']}x fp16 at M <= 16, large shapes | min {min(small):.2f}x | "
                   f"{_mark(min(small) >= t['gemm_small_m'])} |")  # fmt: skip
    if m1:
        out.append(f"| >= {t['gemm_vs_tinygemm_m1']}x tinygemm at M = 1 | min {min(m1):.2f}x | "
                   f"{_mark(min(m1) >= t['gemm_vs_tinygemm_m1'])} |")  # fmt: skip
    if large:
        out.append(f"| >= {t['gemm_large_m']}x fp16 at M >= 128 | min {min(large):.2f}x | "
                   f"{_mark(min(large) >= t['gemm_large_m'])} |")  # fmt: skip
    if sweeps := [row for row in r["rows"] if row.get("sweep_best_config")]:
        out += ["", "| shape | M | heuristic us | best sweep us | config |", "|---|---|---|---|---|"]
        for row in sweeps:
            out.append(f"| {row['shape']} | {row['M']} | {_f(row.get('fused_us') or row['w4a16_us'])} | "
                       f"{row['sweep_best_us']:.1f} | `{row['sweep_best_config']}` "
                       f"(rel err {row.get('sweep_best_rel_err', float('nan')):.1e}) |")  # fmt: skip
    return out


def _decode(r: dict) -> list[str]:
    out = [
        f"{r.get('device')}, {r.get('shape')} shape, {r.get('ctx')} tokens of context, {r.get('steps')} timed steps.",
        "",
        "| weights | mode | batch | tok/s |",
        "|---|---|---|---|",
    ]
    best: dict[int, float] = {}
    for row in r.get("rows", []):
        out.append(f"| {row['weights']} | {row.get('mode', 'eager')} | {row['batch']} | {row['tok_per_s']} |")
        if row["weights"] == "int4":
            best[row["batch"]] = max(best.get(row["batch"], 0.0), row["tok_per_s"])
    for err in r.get("errors", []):
        out.append(f"\nerror: {err}")
    if r.get("shape") in ("Llama-3-8B", "llama3-8b"):
        out += ["", "| target | measured (best mode) | |", "|---|---|---|"]
        for batch, key in ((1, "decode_b1"), (16, "decode_b16")):
            got = best.get(batch)
            ok = None if got is None else got >= TARGETS[key]
            out.append(f"| >= {TARGETS[key]:.0f} tok/s at batch {batch}, 4-bit | {_f(got)} | {_mark(ok)} |")
    return out


def _serve(r: dict) -> list[str]:
    if "answer" not in r:
        return [f"not run: {r.get('error', '?')}"]
    out = [
        f"`{r.get('command', '')}`: ready in {r.get('ready_s')} s; the Paris question "
        f"({'answered' if r.get('paris') else 'NOT answered'}): {r['answer']!r}",
    ]
    if bench := r.get("bench"):
        out += [
            "",
            "| clients | ok | errors | tok/s | TTFT p50 ms | TPOT p50 ms |",
            "|---|---|---|---|---|---|",
        ]
        for b in bench:
            out.append(f"| {b['concurrency']} | {b['num_ok']} | {b['num_errors']} | {_f(b['agg_tok_s'])} | "
                       f"{_f(b['ttft_p50_ms'])} | {_f(b['tpot_p50_ms'])} |")  # fmt: skip
    if r.get("error"):
        out.append(f"\nerror: {r['error']}")
    return out
