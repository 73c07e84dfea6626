"""The `quantserve convert` command: GGUF -> HF checkpoint, or HF checkpoint -> GGUF, picked from the source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from quantserve.cli.common import fail
from quantserve.errors import ConfigError, QuantserveError, UnsupportedFormatError, require_torch
from quantserve.formats.schemes import writable_schemes

QUANT_METHODS = ("gptq", "awq", "awq-gptq", "rtn")  # -> a quantized HF directory (converters/calibration)


def _size(path: Path) -> str:
    n = sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size
    return f"{n / 2**20:.1f} MiB"


@click.command()
@click.option(
    "--src", required=True, type=click.Path(path_type=Path), help="A .gguf file, or an HF model directory."
)
@click.option(
    "--dst",
    required=True,
    type=click.Path(path_type=Path),
    help="Output: a directory (-> HF) or a .gguf file.",
)
@click.option("--quant", default=None, help="-> GGUF file type: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k "
              "q2_k_s q3_k_s q3_k_m q3_k_l q4_k_s q4_k_m q5_k_s q5_k_m q6_k (q4k = q4_k_m), the i-quants iq4_xs iq4_nl "
              "iq3_m iq3_s iq3_xs iq3_xxs iq2_m iq2_s iq2_xs iq2_xxs iq1_m iq1_s (all but iq4_*, iq3_m and iq3_s "
              "need --calib or --imatrix); or -> a quantized HF "
              "directory: gptq, awq, awq-gptq (AWQ's scales, then GPTQ's rounding), rtn, or fp8 (per-channel "
              "FP8 weights in compressed-tensors' format, as llm-compressor's FP8_DYNAMIC; no calibration).")  # fmt: skip
@click.option("--format", "fmt", type=click.Choice(writable_schemes()), default=None,
              help="Quantized HF output format [default: gptq for --quant gptq/rtn, awq for awq]. With a "
              "GPTQ/AWQ/compressed-tensors/Marlin --src and no --quant: repack losslessly.")  # fmt: skip
@click.option("--bits", type=click.Choice(["2", "3", "4", "8"]), default="4", show_default=True,
              help="gptq/awq/rtn: bits per weight.")  # fmt: skip
@click.option("--group-size", type=int, default=128, show_default=True,
              help="gptq/awq/rtn: weights per scale along the input dimension (-1: one group per row). It must "
              "divide every layer's input size (SmolLM2's 576 needs 64).")  # fmt: skip
@click.option(
    "--act-order",
    type=click.Choice(["off", "static", "group"]),
    default=None,
    help="gptq: quantize columns in order of decreasing activation energy; static keeps groups contiguous "
    "(plain g_idx, Marlin's fast path), group forms them in that order (desc_act g_idx) [default: static].",
)
@click.option("--sym/--asym", default=None,
              help="Symmetric weights, or zero points [default: --sym for gptq/rtn, --asym for awq].")  # fmt: skip
@click.option("--calib", default=None, metavar="builtin|self|FILE",
              help="gptq/awq calibration: 'builtin' (a small built-in English text, the default), 'self' (text the "
              "model samples itself, data-free: works offline for any model) or a UTF-8 text file. With a GGUF "
              "--quant: a calibrated GGUF, the same file type and tensor sizes with GPTQ choosing the codes inside "
              "llama.cpp's blocks (and an importance matrix from the same tokens unless --imatrix is given).")  # fmt: skip
@click.option("--calib-dataset", default=None, metavar="ORG/NAME[:CONFIG]",
              help="Calibrate on a Hugging Face dataset's train split instead (needs `datasets` and network).")  # fmt: skip
@click.option("--bits-budget", type=click.FloatRange(min=1.0), default=None, metavar="B",
              help="Mixed precision: measure each linear's sensitivity (KL of the final logits when it alone is "
              "rounded), then raise the most sensitive to 8 bits until the linears average B bits per weight "
              "(scales and zeros counted). Written as GPTQModel `dynamic` overrides (--format gptq).")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --calib self.")
@click.option("--calib-samples", type=click.IntRange(min=1), default=None, help="gptq/awq: calibration sequences [default: 128, "
              "or as many as the text gives].")  # fmt: skip
@click.option(
    "--calib-seq-len",
    type=click.IntRange(min=16),
    default=None,
    help="gptq/awq: tokens per sequence [default: 512].",
)
@click.option("--quantize-deltanet", is_flag=True,
              help="gptq/awq/rtn on Qwen3.5: quantize the Gated DeltaNet layers' in_proj_qkv, in_proj_z and out_proj "
              "too. By default they stay in the checkpoint's dtype, as the published Qwen3.5 recipes keep them.")  # fmt: skip
@click.option("--damp-percent", type=float, default=0.01, show_default=True,
              help="gptq: dampening added to the Hessian's diagonal, as a fraction of its mean.")  # fmt: skip
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="-> HF weight dtype [default: bf16].",
)
@click.option(
    "--imatrix",
    type=click.Path(path_type=Path),
    default=None,
    help="-> GGUF: importance matrix GGUF from llama-imatrix.",
)
@click.option(
    "--mmproj-type",
    type=click.Choice(["f16", "f32"]),
    default=None,
    help="LLaVA -> GGUF: the vision projector's (mmproj) type [default: f16, as llama.cpp ships it].",
)
@click.option(
    "--threads", type=int, default=None, help="Threads for llama.cpp's quantizer [default: all cores]."
)
@click.option("--force", is_flag=True, help="Overwrite --dst if it exists.")
@click.option("--check", is_flag=True, help="Then compare output and source in a table: size, bits/weight, PPL, KL, "
              "top-1, scored by llama.cpp (HF sides as GGUF: dense ones converted losslessly and cached, quantized "
              "ones through their exact dequantized weights).")  # fmt: skip
@click.option(
    "--check-text",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text for --check [default: a built-in English text of about 1,500 tokens].",
)
@click.option("--summary/--no-summary", default=True, show_default=True,
              help="After --quant, one line: the output's size, bits/weight (weight-file bytes x 8 / all parameters, "
              "embeddings and output layer included) and, on the built-in text, PPL of source and output and mean "
              "KL(source || output); seconds for a small model. A 4/8-bit quantized HF output is scored by the "
              "torch backend, a GGUF by llama.cpp (the source converted to a temporary GGUF; --threads applies). "
              "Conversions without --quant (GGUF -> HF, repacking) lose nothing and print none; --check prints the "
              "table instead.")  # fmt: skip
def convert(src: Path, dst: Path, quant: str | None, fmt: str | None, bits: str, group_size: int, act_order: str | None,
            sym: bool | None, calib: str | None, calib_dataset: str | None, bits_budget: float | None, seed: int,
            calib_samples: int | None, calib_seq_len: int | None, quantize_deltanet: bool, damp_percent: float, dtype: str | None, imatrix: Path | None, mmproj_type: str | None,
            threads: int | None, force: bool, check: bool, check_text: Path | None,
            summary: bool) -> None:  # fmt: skip
    """Convert between GGUF, dense HF and quantized HF (GPTQ, AWQ, compressed-tensors, Marlin) checkpoints; an FP8
    or other quantized HF checkpoint also converts to GGUF, through its exact dequantized weights.

    \b
    Examples:
      quantserve convert --src model.gguf --dst model-hf/ --dtype bf16
      quantserve convert --src model-hf/ --dst model.Q4_K_M.gguf --quant q4_k_m
      quantserve convert --src model-hf/ --dst model.Q4_K_M.gguf --quant q4_k_m --imatrix imatrix.gguf
      quantserve convert --src model-hf/ --dst model.Q4_K_M.gguf --quant q4_k_m --calib builtin
      quantserve convert --src llava-1.5-7b-hf/ --dst out/ --quant q4_k_m      (text GGUF + mmproj)
      quantserve convert --src model-hf/ --dst model-gptq/ --quant gptq --group-size 128 --act-order group
      quantserve convert --src model-hf/ --dst model-awq/ --quant awq --calib my-text.txt
      quantserve convert --src model-gptq/ --dst model-marlin/ --format marlin
      quantserve convert --src Qwen3-8B-FP8/ --dst qwen3-8b.Q8_0.gguf --quant q8_0
    """
    from quantserve.converters import gguf_to_hf, hf_to_gguf, llava_to_gguf
    from quantserve.formats import detect
    from quantserve.formats.hf_config import is_llava

    quant = quant.lower() if quant else None
    companions: list[str] = []
    try:
        spec = detect(src)
        src_fmt = spec.format
        llava = src_fmt == "safetensors" and is_llava(spec.config)
        _fail_if(mmproj_type and not llava, "--mmproj-type applies to LLaVA checkpoints (HF -> GGUF) only")
        _fail_if(quantize_deltanet and quant not in QUANT_METHODS,
                 f"--quantize-deltanet applies to --quant {'|'.join(QUANT_METHODS)}")  # fmt: skip
        if quant == "fp8":
            _fail_if(fmt or calib or calib_dataset or imatrix or dtype or bits_budget or act_order or sym is not None
                     or bits != "4" or group_size != 128, "--quant fp8 takes no other quantization options: one "
                     "scale per output channel, no calibration")  # fmt: skip
            require_torch("--quant fp8")
            from quantserve.converters.fp8 import quantize_fp8_checkpoint

            out = quantize_fp8_checkpoint(src, dst, force=force)
            click.echo(f"wrote {out} ({_size(out)}): FP8 weights, compressed-tensors float-quantized")
            if check:
                click.echo(_check(src, dst, check_text, threads))
            elif summary:
                click.echo(_summary(src, dst, threads))
            return
        if quant in QUANT_METHODS or (fmt and not quant) or calib or calib_dataset:
            require_torch(f"--quant {quant}" if quant in QUANT_METHODS else "--format" if fmt else "--calib")
        if quant in QUANT_METHODS or (fmt and not quant):
            _fail_if(dtype or imatrix, "--dtype and --imatrix do not apply to GPTQ/AWQ/RTN output")
            calibration = _Calibration(calib, calib_dataset, calib_samples, calib_seq_len, seed, bits_budget)
            click.echo(_to_quantized_hf(src, dst, src_fmt, quant, fmt, int(bits), group_size, act_order, sym,
                                        calibration, damp_percent, force, quantize_deltanet))  # fmt: skip
            if check:
                click.echo(_check(src, dst, check_text, threads))
            elif summary and quant:
                click.echo(_summary(src, dst, threads))
            return
        if fmt:
            raise ConfigError("--format writes quantized HF directories; use it with --quant gptq|awq|rtn")
        fmt = src_fmt
        if fmt == "gguf":
            if quant or imatrix or threads or calib or calib_dataset:
                raise ConfigError(
                    "--quant, --calib, --imatrix and --threads apply to HF -> GGUF; GGUF -> HF takes --dtype"
                )
            out = gguf_to_hf(src, dst, dtype=dtype or "bf16", force=force)
        elif fmt == "safetensors":
            if dtype:
                raise ConfigError(
                    "--dtype applies to GGUF -> HF; for HF -> GGUF pass --quant (e.g. --quant f16)"
                )
            if not quant:
                raise ConfigError(
                    "pass --quant for HF -> GGUF, e.g. --quant q4_k_m (or f16 for no quantization)"
                )
            _fail_if(llava and (calib or calib_dataset), "--calib applies to language models; a LLaVA "
                     "checkpoint converts with llama.cpp's rounding (drop --calib, or pass --imatrix)")  # fmt: skip
            if llava:  # the language model and its vision projector, the pair llama.cpp's libmtmd loads
                files = llava_to_gguf(src, dst, quant, mmproj_type or "f16", imatrix, force, threads)
                out = files.text
                companions.append(
                    f"wrote {files.mmproj} ({_size(files.mmproj)}): the vision projector (mmproj)"
                )
            elif calib or calib_dataset:
                _fail_if(act_order == "group", "--act-order group forms GPTQ groups; a GGUF's blocks are fixed "
                         "by its type, so --calib takes --act-order static (the default) or off")  # fmt: skip
                _fail_if(bits_budget or sym is not None or bits != "4" or group_size != 128,
                         "--calib with a GGUF --quant keeps the file type's own bits, groups and mix; drop "
                         "--bits, --group-size, --sym/--asym and --bits-budget")  # fmt: skip
                calibration = _Calibration(calib, calib_dataset, calib_samples, calib_seq_len, seed, None)
                line, out = _to_calibrated_gguf(src, dst, quant, calibration, act_order, damp_percent, imatrix,
                                                threads, force)  # fmt: skip
                companions.append(line)
            else:
                out = hf_to_gguf(src, dst, quant=quant, imatrix=imatrix, force=force, nthread=threads)
        elif spec.scheme is not None:  # a quantized HF checkpoint: its exact dense weights, then HF -> GGUF
            _fail_if(dtype or calib or calib_dataset or not quant, f"{src} is {spec.scheme.summary()}; convert it "
                     "to GGUF with --quant (e.g. --quant q8_0, which keeps 8-bit and FP8 weights nearly exact)")  # fmt: skip
            out = _quantized_to_gguf(spec, Path(dst), quant, imatrix, force, threads)
        else:
            raise UnsupportedFormatError(
                f"{src} is a {fmt} checkpoint; convert reads GGUF files and dense or quantized safetensors "
                "checkpoints"
            )
    except QuantserveError as exc:
        fail(exc)
    click.echo(f"wrote {out} ({_size(out)})" + (": the language model" if llava else ""))
    for line in companions:
        click.echo(line)
    if check:
        try:
            click.echo(_check(src, out, check_text, threads))
        except QuantserveError as exc:
            fail(exc)
    elif summary and quant and not _is_float(quant):  # a float output loses nothing to report
        click.echo(_summary(src, out, threads))


def _quantized_to_gguf(
    spec, dst: Path, quant: str, imatrix: str | None, force: bool, threads: int | None
) -> Path:
    """GPTQ, AWQ, Marlin, compressed-tensors or FP8 to GGUF, as llama.cpp's own converter takes FP8: the weights
    dequantized exactly (fp32, in a folder beside `dst` removed after), then written at `quant`."""
    import tempfile

    from quantserve.converters import hf_to_gguf
    from quantserve.quant.dequantize import dequantize_checkpoint

    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".quantserve-dequant-", dir=dst.parent) as tmp:
        dense = dequantize_checkpoint(
            spec.directory, Path(tmp) / spec.directory.name, dtype="float32"
        )  # its name names the GGUF
        return hf_to_gguf(dense, dst, quant=quant, imatrix=imatrix, force=force, nthread=threads)


def _is_float(quant: str) -> bool:
    from quantserve.gguf.quant_types import parse_quant

    return quant not in QUANT_METHODS and parse_quant(quant).name in ("f32", "f16", "bf16")


def _fail_if(cond: object, message: str) -> None:
    if cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class _Calibration:
    calib: str | None
    dataset: str | None
    samples: int | None
    seq_len: int | None
    seed: int
    bits_budget: float | None


def _to_quantized_hf(src: Path, dst: Path, src_fmt: str, quant: str | None, fmt: str | None, bits: int,
                     group_size: int, act_order: str | None, sym: bool | None, c: _Calibration,
                     damp_percent: float, force: bool, deltanet: bool = False) -> str:  # fmt: skip
    from quantserve.converters.calibration.quantize import quantize_checkpoint, repack_checkpoint

    if quant is None:  # --format alone: repack an already-quantized checkpoint
        if c.calib or c.dataset or c.bits_budget or act_order or sym is not None:
            raise ConfigError("repacking (--format without --quant) keeps the weights as they are; drop the "
                              "quantization options (--act-order, --sym/--asym, --calib, --bits-budget)")  # fmt: skip
        out = repack_checkpoint(src, dst, fmt, force=force)
        return f"repacked {src} ({src_fmt}) as {fmt}: {out} ({_size(out)})"
    if src_fmt != "safetensors":
        raise ConfigError(
            f"{src} is {src_fmt}; --quant {quant} quantizes dense fp16/bf16/fp32 HF checkpoints"
            + (
                " (convert the GGUF to HF first: quantserve convert --src FILE.gguf --dst DIR)"
                if src_fmt == "gguf"
                else ""
            )
        )
    r = quantize_checkpoint(
        src, dst, quant, fmt=fmt, bits=bits, group_size=group_size, sym=sym, act_order=act_order, calib=c.calib,
        calib_dataset=c.dataset, n_samples=c.samples, seq_len=c.seq_len, damp_percent=damp_percent,
        bits_budget=c.bits_budget, seed=c.seed, force=force, deltanet=deltanet,
    )  # fmt: skip
    loss = f", mean GPTQ loss {r.mean_loss:.4g}" if r.mean_loss is not None else ""
    mixed = f", {len(r.overrides)} linears at 8 bits" if r.overrides else ""
    calibrated = f"; calibrated on {r.calibration}" if r.calibration else ""
    return (
        f"wrote {r.path} ({_size(r.path)}): {r.n_linears} linears, {quant} {bits}-bit group {group_size}{mixed} "
        f"({r.linear_bpw:.3f} bits/weight over the linears) as {r.format} in {r.seconds:.1f}s{loss}{calibrated}"
    )


def _to_calibrated_gguf(src: Path, dst: Path, quant: str, c: _Calibration, act_order: str | None,
                        damp_percent: float, imatrix: Path | None, threads: int | None,
                        force: bool) -> tuple[str, Path]:  # fmt: skip
    from quantserve.converters.calibration.driver import DEFAULT_N_SAMPLES, DEFAULT_SEQ_LEN
    from quantserve.converters.calibration.gguf_gptq import calibrated_gguf
    from quantserve.converters.calibration.sources import calibration_set

    cal = calibration_set(src, c.calib, dataset=c.dataset, n_samples=c.samples or DEFAULT_N_SAMPLES,
                          seq_len=c.seq_len or DEFAULT_SEQ_LEN, seed=c.seed)  # fmt: skip
    described = f"{cal.source}: {cal.tokens.shape[0]} x {cal.tokens.shape[1]} tokens"
    r = calibrated_gguf(src, dst, quant, cal.tokens, calibration=described, imatrix=imatrix,
                        act_order=act_order != "off", damp_percent=damp_percent, nthread=threads, force=force)  # fmt: skip
    im = (
        "an importance matrix from the same tokens" if imatrix is None else f"the importance matrix {imatrix}"
    )
    kept = f"; {len(r.kept)} kept llama.cpp's codes (types GPTQ does not round)" if r.kept else ""
    return (
        f"{quant.upper()} with GPTQ's codes in {r.n_rounded} linears{kept}; block scales by llama.cpp with {im}; "
        f"calibrated on {described} in {r.seconds:.1f}s"
    ), r.path


def _check(src: Path, out: Path, text_file: Path | None, threads: int | None) -> str:
    """The --check table: source and output scored on the same text by llama.cpp, the HF sides as GGUF (dense ones
    converted losslessly, at their own dtype, and kept in the in-situ cache; quantized ones through their exact
    dequantized weights)."""
    from quantserve.conversion_quality import conversion_quality, weight_footprint

    text = text_file.read_text(encoding="utf-8") if text_file else None
    q = conversion_quality(src, out, text, threads=threads or 0, backend="llamacpp", use_cache=True)
    src_bytes, src_params = weight_footprint(src)
    rows = [
        ("source", src, src_bytes, src_bytes * 8 / src_params, q.ppl_source, "0", "100 %"),
        ("output", out, q.size_bytes, q.bits_per_weight, q.ppl_output, f"{q.mean_kl:.5f}",
         f"{100 * q.top1_agreement:.2f} %"),
    ]  # fmt: skip
    lines = [
        "",
        "| | path | size | bits/weight | PPL | ΔPPL | mean KL | top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, path, size, bpw, ppl, kl, top1 in rows:
        lines.append(
            f"| {name} | {path} | {size / 2**20:.1f} MiB | {bpw:.2f} | {ppl:.3f} | {100 * (ppl / q.ppl_source - 1):+.2f} % "
            f"| {kl} | {top1} |"
        )
    lines.append(
        f"\n{q.n_scored} tokens scored ({'built-in text' if text_file is None else text_file}) by {q.scored_by} in "
        f"{q.seconds:.1f} s. KL is KL(source || output) in nats per token; size is the weight files, bits/weight "
        "their bytes x 8 / all parameters (embeddings included)."
    )
    return "\n".join(lines)


def _summary(src: Path, out: Path, threads: int | None) -> str:
    """The one line after a quantizing conversion (conversion_quality.conversion_quality on the built-in text, its scorer
    chosen there). The output is written by then: a failure to score it is reported on the line, not as an error."""
    from quantserve.conversion_quality import conversion_quality

    try:
        q = conversion_quality(src, out, threads=threads or 0)
    except QuantserveError as exc:
        return f"quality: not measured ({exc.message}); --no-summary skips it"
    except (RuntimeError, MemoryError) as exc:  # the output is written and sound; only scoring it failed
        return f"quality: not measured ({type(exc).__name__}: {exc}); --no-summary skips it"
    return (
        f"quality: {q.size_bytes / 2**20:.1f} MiB, {q.bits_per_weight:.2f} bits/weight, PPL {q.ppl_source:.3f} -> "
        f"{q.ppl_output:.3f} ({100 * (q.ppl_output / q.ppl_source - 1):+.2f} %), mean KL {q.mean_kl:.4g} against "
        f"the source ({q.n_scored} tokens of the built-in text, {q.scored_by}, {q.seconds:.1f} s)"
    )
