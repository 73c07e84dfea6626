"""The `quantserve convert` command: GGUF -> HF checkpoint, or HF checkpoint -> GGUF, picked from the source."""

from __future__ import annotations

from pathlib import Path

import click

from quantserve.cli.common import fail
from quantserve.errors import ConfigError, QuantserveError, UnsupportedFormatError
from quantserve.formats.schemes import schemes


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
              "q3_k_s q3_k_m q3_k_l q4_k_s q4_k_m q5_k_s q5_k_m q6_k (q4k = q4_k_m); or -> a quantized HF "
              "directory: gptq, awq or rtn.")  # fmt: skip
@click.option("--format", "fmt", type=click.Choice(sorted(schemes())), default=None,
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
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="gptq/awq: UTF-8 calibration text [default: a small built-in text].")  # fmt: skip
@click.option("--calib-samples", type=click.IntRange(min=1), default=None, help="gptq/awq: calibration sequences [default: 128, "
              "or as many as the text gives].")  # fmt: skip
@click.option(
    "--calib-seq-len",
    type=click.IntRange(min=16),
    default=None,
    help="gptq/awq: tokens per sequence [default: 512].",
)
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
@click.option(
    "--check", is_flag=True, help="Then compare output and source: size, bits/weight, PPL, KL, top-1."
)
@click.option(
    "--check-text",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text for --check [default: a built-in English text of about 1,500 tokens].",
)
def convert(src: Path, dst: Path, quant: str | None, fmt: str | None, bits: str, group_size: int, act_order: str | None,
            sym: bool | None, calib: Path | None, calib_samples: int | None, calib_seq_len: int | None,
            damp_percent: float, dtype: str | None, imatrix: Path | None, mmproj_type: str | None,
            threads: int | None, force: bool, check: bool, check_text: Path | None) -> None:  # fmt: skip
    """Convert between GGUF, dense HF and quantized HF (GPTQ, AWQ, compressed-tensors, Marlin) checkpoints.

    \b
    Examples:
      quantserve convert --src model.gguf --dst model-hf/ --dtype bf16
      quantserve convert --src model-hf/ --dst model.Q4_K_M.gguf --quant q4_k_m
      quantserve convert --src model-hf/ --dst model.Q4_K_M.gguf --quant q4_k_m --imatrix imatrix.gguf
      quantserve convert --src llava-1.5-7b-hf/ --dst out/ --quant q4_k_m      (text GGUF + mmproj)
      quantserve convert --src model-hf/ --dst model-gptq/ --quant gptq --group-size 128 --act-order group
      quantserve convert --src model-hf/ --dst model-awq/ --quant awq --calib my-text.txt
      quantserve convert --src model-gptq/ --dst model-marlin/ --format marlin
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
        if quant in ("gptq", "awq", "rtn") or (fmt and not quant):
            _fail_if(dtype or imatrix, "--dtype and --imatrix do not apply to GPTQ/AWQ/RTN output")
            _fail_if(
                check, "--check compares GGUF files; score a quantized directory with `quantserve eval ppl`"
            )
            click.echo(_to_quantized_hf(src, dst, src_fmt, quant, fmt, int(bits), group_size, act_order, sym,
                                        calib, calib_samples, calib_seq_len, damp_percent, force))  # fmt: skip
            return
        if fmt:
            raise ConfigError("--format writes quantized HF directories; use it with --quant gptq|awq|rtn")
        fmt = src_fmt
        if fmt == "gguf":
            if quant or imatrix or threads:
                raise ConfigError(
                    "--quant, --imatrix and --threads apply to HF -> GGUF; GGUF -> HF takes --dtype"
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
            if llava:  # the language model and its vision projector, the pair llama.cpp's libmtmd loads
                files = llava_to_gguf(src, dst, quant, mmproj_type or "f16", imatrix, force, threads)
                out = files.text
                companions.append(
                    f"wrote {files.mmproj} ({_size(files.mmproj)}): the vision projector (mmproj)"
                )
            else:
                out = hf_to_gguf(src, dst, quant=quant, imatrix=imatrix, force=force, nthread=threads)
        else:
            raise UnsupportedFormatError(
                f"{src} is a {fmt} checkpoint; convert reads GGUF files and dense safetensors checkpoints"
            )
    except QuantserveError as exc:
        fail(exc)
    click.echo(f"wrote {out} ({_size(out)})" + (": the language model" if companions else ""))
    for line in companions:
        click.echo(line)
    if check:
        try:
            click.echo(_check(src, out, fmt, check_text))
        except QuantserveError as exc:
            fail(exc)


def _fail_if(cond: object, message: str) -> None:
    if cond:
        raise ConfigError(message)


def _to_quantized_hf(src: Path, dst: Path, src_fmt: str, quant: str | None, fmt: str | None, bits: int,
                     group_size: int, act_order: str | None, sym: bool | None, calib: Path | None,
                     calib_samples: int | None, calib_seq_len: int | None, damp_percent: float,
                     force: bool) -> str:  # fmt: skip
    from quantserve.converters.calibration.quantize import quantize_checkpoint, repack_checkpoint

    if quant is None:  # --format alone: repack an already-quantized checkpoint
        if calib or act_order or sym is not None:
            raise ConfigError("repacking (--format without --quant) keeps the weights as they are; drop the "
                              "quantization options (--act-order, --sym/--asym, --calib)")  # fmt: skip
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
        src, dst, quant, fmt=fmt, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
        calib_text=calib.read_text(encoding="utf-8") if calib else None, n_samples=calib_samples,
        seq_len=calib_seq_len, damp_percent=damp_percent, force=force,
    )  # fmt: skip
    loss = f", mean GPTQ loss {r.mean_loss:.4g}" if r.mean_loss is not None else ""
    return (
        f"wrote {r.path} ({_size(r.path)}): {r.n_linears} linears, {quant} {bits}-bit group {group_size} as "
        f"{r.format} in {r.seconds:.1f}s{loss}"
    )


def _check(src: Path, out: Path, src_format: str, text_file: Path | None) -> str:
    """Score the source and the output on the same text with llama.cpp: both as GGUF, the HF side converted
    losslessly (at its own dtype) for the purpose."""
    from importlib.resources import files

    from quantserve.evaluate import kl_divergence
    from quantserve.formats import detect, summarize
    from quantserve.insitu import ensure_gguf

    text = (
        text_file.read_text(encoding="utf-8")
        if text_file
        else (files("quantserve") / "data/eval.txt").read_text()
    )
    keep = []
    if src_format == "gguf":  # GGUF -> HF: does the HF output still behave like the GGUF it came from?
        base = src
        model, handle = ensure_gguf(detect(out), None, cache_dir=None, use_cache=False)
        keep.append(handle)
    else:  # HF -> GGUF: what did quantization cost against the full-precision source?
        base, _ = ensure_gguf(detect(src), None, cache_dir=None, use_cache=True)
        model = out
    r = kl_divergence(base, model, text)
    rows = [("source", src, base, r.ppl_base), ("output", out, model, r.ppl_model)]
    lines = [
        "",
        "| | path | size | bits/weight | PPL | ΔPPL | mean KL | top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, shown, gguf, ppl in rows:
        s = summarize(gguf)
        delta = 100 * (ppl / r.ppl_base - 1)
        kl, top1 = (
            ("0", "100 %") if name == "source" else (f"{r.mean_kl:.5f}", f"{100 * r.top1_agreement:.2f} %")
        )
        lines.append(
            f"| {name} | {shown} | {_size(shown)} | {s.bits_per_weight:.2f} | {ppl:.3f} | {delta:+.2f} % "
            f"| {kl} | {top1} |"
        )
    lines.append(
        f"\n{r.n_scored} tokens scored ({'built-in text' if text_file is None else text_file}); "
        "KL is KL(source || output) in nats per token."
    )
    for handle in keep:
        handle.cleanup()
    return "\n".join(lines)
