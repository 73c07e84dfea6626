"""One gpt-oss mixture-of-experts layer, gpt-oss-20b's shape (hidden 2880, 32 experts of 2880, top-4), on a GPU.

Measured in the same process on the same random MXFP4 experts (as gpt-oss ships them) and the same routing, each
through the torch backend's own module (backends/torch/gpt_oss.py's OssMoe):

- `grouped mxfp4`: ours, every expert in two GEMM launches of kernels/mxfp4.py's grouped GEMM, timed eagerly as
  the server runs it today (its decode steps are not graphed for gpt-oss yet), and in a CUDA graph too;
- `loop mxfp4`: the per-expert loop it replaced, one MXFP4 GEMM a chosen expert, the choice read on the host;
- `loop bf16`: the same loop on the experts dequantized to bf16, through cuBLAS (what a bf16 checkpoint costs);
- `grouped_mm bf16`: torch's own grouped GEMM (`torch._grouped_mm`, sm90) on the dequantized experts, tokens
  sorted by expert: the dense peer with one launch a projection (eager, and in a CUDA graph).

The ratios compare eager times; the graphed ones show what CUDA graphs would add.

Each output is checked against the fp32 loop on the dequantized weights (relative error; bf16's own rounding of
the output sits near 4e-3).

    python bench/mxfp4_moe.py --out bench/results/mxfp4-moe.json      # on a CUDA machine
    python bench/mxfp4_moe.py --cpu-smoke                             # tiny shape, Triton interpreted
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_gemm  # noqa: E402
from moe_gemm import cell, event_ms, graph_ms  # noqa: E402

from quantserve.backends.torch.gpt_oss import OssMoe  # noqa: E402
from quantserve.kernels import mxfp4  # noqa: E402
from quantserve.kernels.reference import relative_error  # noqa: E402

SHAPE = {"hidden": 2880, "inter": 2880, "experts": 32, "top_k": 4}  # gpt-oss-20b (config.json)
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU


def layers(shape: dict, device: str) -> tuple[OssMoe, OssMoe, OssMoe]:
    """The same random experts three ways: MXFP4 blocks, dequantized to bf16, and to fp32 (the reference)."""
    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    gen = torch.Generator(device=device).manual_seed(0)

    def random_mxfp4(
        n: int, kk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # an expert at a time: less memory
        parts = [mxfp4.quantize(torch.randn(n, kk, generator=gen, device=device) * 0.02) for _ in range(e)]
        return torch.stack([b for b, _ in parts]), torch.stack([s for _, s in parts])

    with torch.device(device), torch.no_grad():
        packed = OssMoe(e, k, h, i, ALPHA, LIMIT, packed=True)
        packed.router.weight.normal_(0, 1, generator=gen)
        packed.router.bias.zero_()
        ex = packed.experts
        for which, (n, kk) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            blocks, scales = random_mxfp4(n, kk)
            getattr(ex, f"{which}_blocks").copy_(blocks), getattr(ex, f"{which}_scales").copy_(scales)
        ex.gate_up_proj_bias.normal_(0, 0.1, generator=gen), ex.down_proj_bias.normal_(0, 0.1, generator=gen)
        dense = {}
        for dtype in (torch.bfloat16, torch.float32):
            m = OssMoe(e, k, h, i, ALPHA, LIMIT, packed=False)
            m.router.load_state_dict(packed.router.state_dict())
            for which in ("gate_up_proj", "down_proj"):  # [E, in, out], as transformers keeps them
                blocks, scales = getattr(ex, f"{which}_blocks"), getattr(ex, f"{which}_scales")
                for x in range(e):
                    getattr(m.experts, which)[x].copy_(mxfp4.dequantize(blocks[x], scales[x]).T)
                getattr(m.experts, f"{which}_bias").copy_(getattr(ex, f"{which}_bias"))
            dense[dtype] = m.to(dtype)
    return packed.to(torch.bfloat16), dense[torch.bfloat16], dense[torch.float32]


def grouped_mm(moe: OssMoe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over the slots sorted by expert, with the experts' biases and the clamped SwiGLU."""
    ex, k = moe.experts, ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(ex.gate_up_proj.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = counts.cumsum(0, dtype=torch.int32)
    experts = flat[order]
    h = torch._grouped_mm(x[order // k], ex.gate_up_proj, offs=offs) + ex.gate_up_proj_bias[experts]
    gate, up = h[:, 0::2].clamp(max=ex.limit), h[:, 1::2].clamp(-ex.limit, ex.limit)
    act = (up + 1) * gate * torch.sigmoid(gate * ex.alpha)
    y = torch._grouped_mm(act, ex.down_proj, offs=offs) + ex.down_proj_bias[experts]
    y = y.float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros(flat.numel(), y.shape[1], device=x.device, dtype=torch.float32).index_copy_(0, order, y)
    return out.view(-1, k, y.shape[1]).sum(1).to(x.dtype)


def run(shape: dict, tokens: list[int], device: str) -> list[dict]:
    packed, bf16, fp32 = layers(shape, device)
    rows = []
    for t in tokens:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, shape["hidden"], generator=g).to(device)
        with torch.no_grad():
            top, ids = packed.router(x.bfloat16()).topk(shape["top_k"], dim=-1)
            w = torch.softmax(top.float(), dim=-1)
            ref = fp32.run_loop(x, ids, w)
            xb, wb = x.bfloat16(), w.bfloat16()
            calls = {
                "grouped mxfp4": lambda xb=xb, ids=ids, wb=wb: packed.run_grouped(xb, ids, wb),
                "loop mxfp4": lambda xb=xb, ids=ids, wb=wb: packed.run_loop(xb, ids, wb),
                "loop bf16": lambda xb=xb, ids=ids, wb=wb: bf16.run_loop(xb, ids, wb),
            }
            if device == "cuda" and hasattr(torch, "_grouped_mm"):
                calls["grouped_mm bf16"] = lambda xb=xb, ids=ids, wb=wb: grouped_mm(bf16, xb, ids, wb)
            row: dict = {"tokens": t}
            for name, call in calls.items():
                try:
                    row[name] = {"ms": None, "rel_err": relative_error(call(), ref)}
                    if device == "cuda":
                        row[name]["ms"] = event_ms(call)
                    if device == "cuda" and name.startswith("grouped"):
                        try:  # no host sync: a CUDA graph can hold it
                            row[name]["graph_ms"] = graph_ms(call)
                        except Exception as exc:
                            row[name]["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                except Exception as exc:  # a peer this torch or GPU lacks is reported, not fatal
                    row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(t, name, row[name], flush=True)
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    names = ["grouped mxfp4", "loop mxfp4", "loop bf16", "grouped_mm bf16"]
    out = [
        f"One gpt-oss MoE layer, {report['shape']}, on {report['device']} (ms per layer; relative error "
        "against fp32)",
        "",
        "| tokens | "
        + " | ".join(names)
        + " | vs loop mxfp4 | vs grouped_mm bf16 | graphed: grouped mxfp4 | "
        "graphed: grouped_mm bf16 |",
        "|---" * (len(names) + 5) + "|",
    ]
    for r in report["rows"]:
        cells = [cell(r.get(n)) for n in names]

        def ratio(peer: str, r=r) -> str:
            a, b = r.get("grouped mxfp4", {}).get("ms"), r.get(peer, {}).get("ms")
            return f"{b / a:.2f}x" if a and b else "-"

        graphed = [r.get(n, {}).get("graph_ms") for n in ("grouped mxfp4", "grouped_mm bf16")]
        out.append(f"| {r['tokens']} | " + " | ".join(cells) + f" | {ratio('loop mxfp4')} | "
                   f"{ratio('grouped_mm bf16')} | " + " | ".join("-" if g is None else f"{g:.3f}" for g in graphed)
                   + " |")  # fmt: skip
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    return moe_gemm.parser(__doc__)


def main(argv: list[str] | None = None) -> int:
    # ours and the loops must be right (bf16 outputs); torch's grouped_mm is a peer this torch or GPU may lack
    return moe_gemm.bench_main(
        argv, parser(), SHAPE, run, markdown, ("grouped mxfp4", "loop mxfp4", "loop bf16"), 1e-2
    )


if __name__ == "__main__":
    raise SystemExit(main())
