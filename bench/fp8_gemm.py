"""FP8 and NVFP4 linears at Llama-3-8B's shapes (hidden 4096, ffn 14336, 8 KV heads), on a GPU, with bf16 activations.

Measured in the same process on the same random weights, rounded to FP8 e4m3 in 128×128 blocks as the official FP8
releases are, then for each token count M:

- `ours fp8`: kernels/fp8.py's W8A16 Triton GEMM, what the torch backend runs for an FP8 checkpoint: the weight's
  bytes decoded in registers, activations in bf16;
- `cublas bf16`: the same weights dequantized to bf16, through cuBLAS (`x @ W.T`): what a bf16 checkpoint costs;
- `ours nvfp4`: kernels/nvfp4.py's W4A16 GEMM on random NVFP4 weights of the same shape (e2m1 codes, e4m3 scales
  per 16, a global scale), what the torch backend runs for an NVFP4 checkpoint; checked against its own
  dequantization;
- `scaled_mm fp8`: torch._scaled_mm on FP8 tensor cores (sm89+), the activations quantized to FP8 per token at run
  time (that quantization timed too) and the weight with one scale per output row, FP8 × FP8: the W8A8 peer that
  vLLM's FP8 path resembles (it scales per block; `_scaled_mm`'s row-wise scales are the nearest torch has).

Each output is checked against fp32 on the dequantized weights (relative error; `scaled_mm fp8` also rounds its
activations, so its error is larger by design). The decode line adds the four linears of a layer at M = 1 and
multiplies by the 32 layers: the linears' share of one 8B decode step.

    python bench/fp8_gemm.py --out bench/results/fp8-gemm.json      # on a CUDA machine
    python bench/fp8_gemm.py --cpu-smoke                            # tiny shapes, Triton interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_gemm import cell, event_ms  # noqa: E402

from quantserve.kernels import fp8, nvfp4  # noqa: E402
from quantserve.kernels.fp8 import Fp8Weight  # noqa: E402
from quantserve.kernels.nvfp4 import Nvfp4Weight  # noqa: E402
from quantserve.kernels.reference import relative_error  # noqa: E402

# (name, N, K) of one Llama-3-8B layer's linears, q|k|v and gate|up fused as the torch backend fuses them
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32
BLOCK = (128, 128)


def random_fp8(n: int, k: int, device: str, gen: torch.Generator) -> Fp8Weight:
    """Random weights rounded to e4m3 with a scale per 128×128 block (amax / 448)."""
    w = torch.randn(n, k, generator=gen, device=device) * 0.02
    bn, bk = BLOCK
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    scale = padded.abs().amax(dim=(1, 3)) / 448.0
    q = (padded / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(gn * bn, gk * bk)[:n, :k]
    return Fp8Weight(q.contiguous(), scale.contiguous(), BLOCK)


def scaled_mm_peer(w: Fp8Weight):
    """The weight as torch._scaled_mm takes it: FP8 rows with one fp32 scale each, transposed (column-major)."""
    dense = w.dense(torch.float32)
    row_scale = dense.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0  # [N, 1]
    wq = (dense / row_scale).to(torch.float8_e4m3fn)

    def call(x: torch.Tensor) -> torch.Tensor:
        xs = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0  # per token
        xq = (x.float() / xs).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=row_scale.t(), out_dtype=x.dtype)

    return call


def random_nvfp4(n: int, k: int, device: str, gen: torch.Generator) -> Nvfp4Weight:
    """Random NVFP4 bytes (any byte is two e2m1 codes), e4m3 scales and a global scale: its own reference."""
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(n, k // 16, generator=gen, device=device) * 400 + 1).to(torch.float8_e4m3fn)
    return Nvfp4Weight(packed, scales, torch.tensor([448.0 * 6 / 0.1], device=device))


def run(shapes: list, tokens: list[int], device: str) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n, k in shapes:
        w = random_fp8(n, k, device, gen)
        ref_w = w.dense(torch.float32)
        bf16_w = ref_w.to(torch.bfloat16)
        scaled = scaled_mm_peer(w) if device == "cuda" else None
        w4 = random_nvfp4(n, k, device, gen)
        ref_w4 = w4.dequantize(torch.float32)  # [K, N]
        for m in tokens:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            ref = x.float() @ ref_w.T
            calls = {
                "ours fp8": lambda x=x, w=w: fp8.fp8_linear(x, w),
                "cublas bf16": lambda x=x, b=bf16_w: x @ b.T,
                "ours nvfp4": lambda x=x, w4=w4: nvfp4.nvfp4_linear(x, w4),
            }
            refs = {"ours nvfp4": x.float() @ ref_w4}
            if scaled is not None:
                calls["scaled_mm fp8"] = lambda x=x, s=scaled: s(x)
            row: dict = {"linear": name, "N": n, "K": k, "M": m}
            for peer, call in calls.items():
                try:
                    with torch.no_grad():
                        row[peer] = {"ms": None, "rel_err": relative_error(call(), refs.get(peer, ref))}
                        if device == "cuda":
                            row[peer]["ms"] = event_ms(call)
                except Exception as exc:  # a peer this torch or GPU lacks is reported, not fatal
                    row[peer] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(name, m, peer, row[peer], flush=True)
            rows.append(row)
    return rows


def decode_ms(rows: list[dict], peer: str) -> float | None:
    """One 8B decode step's linears at M = 1: the four of a layer, times the layers."""
    per_layer = [r.get(peer, {}).get("ms") for r in rows if r["M"] == 1]
    return None if not per_layer or None in per_layer else sum(per_layer) * LAYERS


PEERS = ["ours fp8", "ours nvfp4", "cublas bf16", "scaled_mm fp8"]


def markdown(report: dict) -> str:
    out = [
        f"FP8 and NVFP4 linears at Llama-3-8B's shapes on {report['device']}, bf16 activations (ms a call; relative error "
        "against fp32)",
        "",
        "| linear | M | " + " | ".join(PEERS) + " | cublas bf16 / ours fp8 | scaled_mm fp8 / ours fp8 | "
        "cublas bf16 / ours nvfp4 |",
        "|---" * (len(PEERS) + 5) + "|",
    ]
    for r in report["rows"]:

        def ratio(peer: str, ours: str = "ours fp8", r=r) -> str:
            a, b = r.get(ours, {}).get("ms"), r.get(peer, {}).get("ms")
            return f"{b / a:.2f}x" if a and b else "-"

        cells = " | ".join(cell(r.get(p)) for p in PEERS)
        out.append(f"| {r['linear']} {r['N']}x{r['K']} | {r['M']} | {cells} | {ratio('cublas bf16')} | "
                   f"{ratio('scaled_mm fp8')} | {ratio('cublas bf16', 'ours nvfp4')} |")  # fmt: skip
    decode = {p: decode_ms(report["rows"], p) for p in PEERS}
    out += ["", "One 8B decode step's linears (M = 1, 32 layers): " + ", ".join(
        f"{p} {'-' if v is None else format(v, '.2f')} ms" for p, v in decode.items())]  # fmt: skip
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64],
                    help="token counts M (default 1,16,64)")  # fmt: skip
    ap.add_argument("--out", help="write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        shapes, device, tokens = [("qkv", 96, 128), ("down", 64, 160)], "cpu", [1, 3]
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU here; use --cpu-smoke")
        shapes, device, tokens = SHAPES, "cuda", args.tokens
    rows = run(shapes, tokens, device)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__,
        "block": list(BLOCK),
        "rows": rows,
        "host": platform.node(),
        "decode_ms": {p: decode_ms(rows, p) for p in PEERS},
    }
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["markdown"] = markdown(report)
    print(report["markdown"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    # ours must be right (bf16 rounding of the output: ~4e-3); the peers are reported, not judged
    return 0 if all(r[p].get("rel_err", 1.0) < 1e-2 for r in rows for p in ("ours fp8", "ours nvfp4")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
