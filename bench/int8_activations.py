"""What serving an INT8 W8A8 checkpoint as W8A16 changes: the torch backend runs llm-compressor's W8A8 checkpoints
(compressed-tensors int-quantized) with the activations unquantized. This scores, on the same chunks of text, the
dense source, the checkpoint as served (W8A16), and the checkpoint as its config means it (W8A8: every quantized
linear's input rounded to int8 per token, symmetric, amax / 127, as vLLM's dynamic per-token path computes it before
its int8 GEMM), and reports each one's perplexity and KL divergence.

    python bench/int8_activations.py --base DENSE_DIR --model W8A8_DIR --out bench/results/int8-activations.json

A W8A8 checkpoint of a dense one: llm-compressor's W8A8 recipe, or tests/fixtures/fp8.py's write_compressed(src, dst,
"W8A8"), which writes it with compressed-tensors (min/max weight scales, no SmoothQuant).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from datetime import date
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from quantserve.backends.torch.quant_linear import QuantLinear
from quantserve.evaluate import Scorer


def int8_per_token(module: torch.nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the input rounded to int8 per token (row), symmetric, as the checkpoint's
    `input_activations: {num_bits: 8, strategy: token, dynamic: true}` says."""
    (x,) = args
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return ((x / scale).round().clamp(-127, 127) * scale,)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base", required=True, type=Path, help="the dense checkpoint the W8A8 one was made from"
    )
    ap.add_argument(
        "--model", required=True, type=Path, help="the W8A8 checkpoint (compressed-tensors int-quantized)"
    )
    ap.add_argument("--text", type=Path, help="text to score [default: quantserve's built-in eval.txt]")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument(
        "--out", type=Path, help="write the results as JSON here (and the table beside it as .md)"
    )
    args = ap.parse_args(argv)
    text = args.text.read_text() if args.text else files("quantserve.data").joinpath("eval.txt").read_text()
    t0 = time.monotonic()
    base, model = Scorer(args.base, "torch", n_ctx=args.n_ctx), Scorer(args.model, "torch", n_ctx=args.n_ctx)
    linears = [m for m in model.runner.model.modules() if isinstance(m, QuantLinear)]
    tokens = base.tokenize(text)
    names = ("dense", "W8A16 (as served)", "W8A8 (as the config means it)")
    nll = dict.fromkeys(names, 0.0)
    kl = dict.fromkeys(names[1:], 0.0)
    kl_between, top1, count = 0.0, dict.fromkeys(names[1:], 0), 0
    ref_chunks = list(base.chunks(tokens))
    served_chunks = [logp for logp, _ in model.chunks(tokens)]
    hooks = [m.register_forward_pre_hook(int8_per_token) for m in linears]
    try:
        w8a8_chunks = [logp for logp, _ in model.chunks(tokens)]
    finally:
        for h in hooks:
            h.remove()
    for (ref, targets), served, w8a8 in zip(ref_chunks, served_chunks, w8a8_chunks, strict=True):
        rows = np.arange(len(targets))
        for name, logp in zip(names, (ref, served, w8a8), strict=True):
            nll[name] -= float(logp[rows, targets].sum())
        for name, logp in zip(names[1:], (served, w8a8), strict=True):
            kl[name] += float((np.exp(ref) * (ref - logp)).sum())
            top1[name] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        kl_between += float((np.exp(served) * (served - w8a8)).sum())
        count += len(targets)
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}",
        "base": str(args.base),
        "model": str(args.model),
        "settings": {
            "n_ctx": args.n_ctx,
            "scored_tokens": count,
            "text": str(args.text or "quantserve/data/eval.txt"),
        },
        "ppl": {n: math.exp(v / count) for n, v in nll.items()},
        "kl_vs_dense": {n: v / count for n, v in kl.items()},
        "top1_vs_dense": {n: v / count for n, v in top1.items()},
        "kl_w8a16_vs_w8a8": kl_between / count,
        "scored_by": model.scored_by,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    lines = [
        f"INT8 W8A8 served as W8A16: {args.model} against {args.base}, {count} tokens scored in chunks of "
        f"{args.n_ctx}, {report['scored_by']}, on {report['machine']}, {report['date']}",
        "",
        "| weights / activations | PPL | KL vs dense | top-1 vs dense |",
        "|---|---|---|---|",
        f"| dense | {report['ppl']['dense']:.4f} | - | - |",
    ] + [
        f"| {n} | {report['ppl'][n]:.4f} | {report['kl_vs_dense'][n]:.5f} | {report['top1_vs_dense'][n]:.4f} |"
        for n in names[1:]
    ]  # fmt: skip
    lines += ["", f"KL(W8A16 || W8A8): {report['kl_w8a16_vs_w8a8']:.5f} per token"]
    report["markdown"] = "\n".join(lines)
    print(report["markdown"])
    for s in (base, model):
        s.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(report["markdown"] + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
