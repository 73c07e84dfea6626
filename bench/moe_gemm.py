"""One mixture-of-experts layer, Qwen3-30B-A3B's shape (hidden 2048, 128 experts of 768, top-8), on a GPU.

Measured in the same process on the same random int4 experts (group 128, symmetric) and the same routing:

- `grouped int4`: ours, kernels/w4a16_moe.py: the stacked experts in two launches (CUDA-graph timed);
- `loop int4`: the per-expert loop the torch backend ran before (one Triton W4A16 GEMM per chosen expert, the
  choice read on the host), which still serves experts the grouped kernel cannot stack;
- `loop fp16`: the same loop on the experts dequantized to fp16, through cuBLAS (what dense experts cost);
- `grouped_mm bf16`: torch's own grouped GEMM (`torch._grouped_mm`, sm90) on the dequantized experts in bf16,
  tokens sorted by expert: the dense peer with one launch per projection (CUDA-graph timed).

The loops sync with the host, so they are timed by events around whole calls. Every output is checked against an
fp32 loop on the dequantized weights (relative error, the kernels' 1e-3 bar; bf16's own rounding sits above it).

    python bench/moe_gemm.py --out bench/results/moe-gemm.json      # on a CUDA machine
    python bench/moe_gemm.py --cpu-smoke                            # tiny shape, Triton interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantserve.kernels.reference import relative_error  # noqa: E402
from quantserve.kernels.w4a16_moe import fused_moe, stack_experts  # noqa: E402
from quantserve.kernels.w4a16_plain import PlainState, plain_dequantize, plain_gemm  # noqa: E402

SHAPE = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}  # Qwen3-30B-A3B (config.json)
TOKENS = [1, 4, 16, 64, 256, 1024]


def random_state(k: int, n: int, group: int, device: str, gen: torch.Generator) -> PlainState:
    words = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.002 + 0.0005).half()
    return PlainState(words.to(device), scales.to(device), None, None, 4, group, k, n)


def loop(x, ids, weights, project) -> torch.Tensor:
    """The per-expert loop of backends/torch/moe.py; project(e, 0 | 1, rows) runs expert e's gate|up or down."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        h = project(e, 0, x[rows])
        inter = h.shape[1] // 2
        act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
        out.index_add_(0, rows, project(e, 1, act).float() * weights[rows, slot, None].float())
    return out.to(x.dtype)


def grouped_mm(x, ids, weights, gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over tokens sorted by expert: gu [E, H, 2I], dn [E, I, H] in bf16."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gu.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, gu, offs=offs)
    inter = dn.shape[1]
    act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
    y = torch._grouped_mm(act, dn, offs=offs).float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros(t * k, y.shape[1], device=x.device, dtype=torch.float32).index_copy_(0, order, y)
    return out.view(t, k, -1).sum(1).to(x.dtype)


def event_ms(call, iters: int = 20, repeats: int = 5) -> float:
    from w4a16_gemm import event_median_ms

    for _ in range(3):
        call()
    return event_median_ms(call, iters, repeats)


def graph_ms(call, iters: int = 20, repeats: int = 5) -> float:
    from w4a16_gemm import graph_time_us

    return graph_time_us([call], iters, repeats) / 1e3


def run(shape: dict, tokens: list[int], device: str, interpret: bool) -> list[dict]:
    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    gen = torch.Generator().manual_seed(0)
    states = [[random_state(h, i, 128 if h % 128 == 0 else h, device, gen) for _ in range(2)]
              + [random_state(i, h, 128 if i % 128 == 0 else i, device, gen)] for _ in range(e)]  # fmt: skip
    gate_up = stack_experts([s[:2] for s in states])
    down = stack_experts([s[2:] for s in states])
    dense16 = [[plain_dequantize(s, torch.float16, interpret) for s in trio] for trio in states]
    gu16 = torch.stack([torch.cat(trio[:2], dim=1) for trio in dense16])  # [E, H, 2I]
    dn16 = torch.stack([trio[2] for trio in dense16])  # [E, I, H]

    def int4(ex, which, rows):
        if which == 0:
            return torch.cat([plain_gemm(rows, s, interpret=interpret) for s in states[ex][:2]], dim=1)
        return plain_gemm(rows, states[ex][2], interpret=interpret)

    def fp16(ex, which, rows):
        return rows @ (gu16[ex] if which == 0 else dn16[ex])

    def fp32(ex, which, rows):
        return rows @ (gu16[ex] if which == 0 else dn16[ex]).float()

    rows_out = []
    for t in tokens:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, h, generator=g).half().to(device)
        w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k, dim=-1)
        ids, w = ids.to(device), (w / w.sum(-1, keepdim=True)).half().to(device)
        ref = loop(x.float(), ids, w, fp32)
        calls = {
            "grouped int4": lambda x=x, ids=ids, w=w: fused_moe(x, gate_up, down, ids, w, interpret),
            "loop int4": lambda x=x, ids=ids, w=w: loop(x, ids, w, int4),
            "loop fp16": lambda x=x, ids=ids, w=w: loop(x, ids, w, fp16),
        }
        if device == "cuda" and hasattr(torch, "_grouped_mm"):
            gub, dnb, xb, wb = gu16.bfloat16(), dn16.bfloat16(), x.bfloat16(), w.bfloat16()
            calls["grouped_mm bf16"] = lambda xb=xb, ids=ids, wb=wb, gub=gub, dnb=dnb: grouped_mm(
                xb, ids, wb, gub, dnb
            )
        row: dict = {"tokens": t}
        for name, call in calls.items():
            try:
                err = relative_error(call(), ref)
                row[name] = {"ms": None, "rel_err": err}
                if device == "cuda" and name.startswith("grouped"):
                    try:  # one launch sequence with no host sync: a CUDA graph holds it, as the server's does
                        row[name]["ms"] = graph_ms(call)
                    except Exception as exc:
                        row[name]["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                if device == "cuda" and row[name]["ms"] is None:
                    row[name]["ms"] = event_ms(call)
            except Exception as exc:  # a peer this torch or GPU lacks is reported, not fatal
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(t, name, row[name], flush=True)
        rows_out.append(row)
        if device == "cuda":
            del calls
            torch.cuda.empty_cache()
    return rows_out


def cell(c: dict | None) -> str:
    """A table cell of one peer's result: "ms (relative error)", "-" where not run, "error" where it failed."""
    if c is None:
        return "-"
    if "error" in c:
        return "error"
    return f"{'-' if c['ms'] is None else format(c['ms'], '.3f')} ({c['rel_err']:.1e})"


def markdown(report: dict) -> str:
    names = ["grouped int4", "loop int4", "loop fp16", "grouped_mm bf16"]
    out = [
        f"One MoE layer, {report['shape']}, on {report['device']} (ms per layer; relative error against fp32)",
        "",
        "| tokens | " + " | ".join(names) + " | grouped int4 vs loop fp16 | vs grouped_mm bf16 |",
        "|---" * (len(names) + 3) + "|",
    ]
    for r in report["rows"]:
        cells = [cell(r.get(n)) for n in names]

        def ratio(peer: str, r=r) -> str:
            a, b = r.get("grouped int4", {}).get("ms"), r.get(peer, {}).get("ms")
            return f"{b / a:.2f}x" if a and b else "-"

        out.append(f"| {r['tokens']} | " + " | ".join(cells) + f" | {ratio('loop fp16')} | "
                   f"{ratio('grouped_mm bf16')} |")  # fmt: skip
    return "\n".join(out)


def parser(doc: str = __doc__) -> argparse.ArgumentParser:
    """The command line of this bench and bench/mxfp4_moe.py (tests/bench/test_gpu_script.py parses bench/gpu/run.py's
    commands with it)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny layer on the CPU, Triton interpreted")
    ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=TOKENS,
                    help="token counts (default 1,4,16,64,256,1024)")  # fmt: skip
    ap.add_argument("--out", help="write the results as JSON here")
    return ap


def bench_main(
    argv: list[str] | None,
    ap: argparse.ArgumentParser,
    shape: dict,
    run_rows: Callable[[dict, list[int], str], list[dict]],
    to_markdown: Callable[[dict], str],
    checked: tuple[str, ...],
    tol: float,
) -> int:
    """Run a MoE layer bench: `shape` on the GPU, or a tiny layer under Triton's interpreter with --cpu-smoke;
    print the table, write the report (--out), and fail unless every `checked` peer is within `tol` of fp32."""
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        shape, device, tokens = {"hidden": 128, "inter": 64, "experts": 8, "top_k": 2}, "cpu", [1, 4, 16]
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU here; use --cpu-smoke")
        device, tokens = "cuda", args.tokens
    rows = run_rows(shape, tokens, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)"
    report = {
        "device": name,
        "shape": shape,
        "torch": torch.__version__,
        "rows": rows,
        "host": platform.node(),
    }
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["markdown"] = to_markdown(report)
    print(report["markdown"])
    ok = all(r[n].get("rel_err", 1.0) < tol for r in rows for n in checked)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    # ours and the loops must be right; torch's grouped_mm is a peer that this torch or GPU may lack
    return bench_main(
        argv, parser(), SHAPE, lambda shape, tokens, device: run(shape, tokens, device, device == "cpu"),
        markdown, ("grouped int4", "loop int4", "loop fp16"), 2e-3,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
