"""What a conversion cost: size, bits per weight, and PPL and KL against its source on a short text, scored by
evaluate.py (`quantserve convert`'s one-line summary and its --check table)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from quantserve.errors import ConfigError, UnsupportedFormatError
from quantserve.evaluate import kl_divergence

log = logging.getLogger("quantserve.evaluate")


def gguf_of(path: Path, *, use_cache: bool) -> tuple[Path, object | None]:
    """A GGUF that llama.cpp scores for the checkpoint at `path`, and a handle keeping a temporary one alive: a GGUF
    as is, a dense HF checkpoint converted losslessly (at its own dtype; kept in the in-situ cache with
    `use_cache`), a quantized one (GPTQ, AWQ, …) through its exact dequantized weights as an f32 GGUF.

    Raises:
        UnsupportedFormatError: a format llama.cpp cannot score even after conversion.
    """
    import tempfile

    from quantserve.formats import detect
    from quantserve.insitu import ensure_gguf

    spec = detect(path)
    if spec.format == "gguf":
        return spec.files[0], None
    if spec.format == "safetensors":
        return ensure_gguf(spec, None, cache_dir=None, use_cache=use_cache)
    if spec.scheme is not None:
        from quantserve.quant.dequantize import dequantize_checkpoint

        # the dense copy goes once converted
        with tempfile.TemporaryDirectory(prefix="quantserve-eval-") as tmp:
            dense = dequantize_checkpoint(path, Path(tmp) / "dense", dtype="float32")
            return ensure_gguf(detect(dense), "f32", cache_dir=None, use_cache=False)
    raise UnsupportedFormatError(
        f"{path} is {spec.format}; scoring reads GGUF, dense and quantized HF checkpoints"
    )


def weight_footprint(path: Path) -> tuple[int, int]:
    """(bytes of the weight files, parameters): a GGUF's whole file (its tokenizer metadata included), an HF
    checkpoint's safetensors files; parameters are logical weights, embeddings and output layer included (a
    packed 4-bit word counts as 8, scales and zero points as none; tied embeddings once)."""
    from quantserve.formats import detect, summarize

    spec = detect(path)
    return sum(f.stat().st_size for f in spec.files), summarize(spec).n_params


@dataclass(frozen=True)
class ConversionQuality:
    """What a conversion cost, measured on a short text: `quantserve convert`'s one-line summary."""

    size_bytes: int  # the output's weight files (weight_footprint)
    bits_per_weight: float  # size_bytes * 8 / the output's parameters
    ppl_source: float
    ppl_output: float
    mean_kl: float  # KL(source || output), nats per scored token
    seconds: float  # all of it: conversions for the scorer, loading, scoring
    top1_agreement: float
    n_scored: int
    scored_by: str  # what scored both models (KLResult.scored_by)


def builtin_text() -> str:
    """quantserve/data/eval.txt: about 1,500 tokens of plain English, two 512-token chunks."""
    from importlib.resources import files

    return (files("quantserve") / "data/eval.txt").read_text(encoding="utf-8")


def conversion_quality(
    src: Path,
    out: Path,
    text: str | None = None,
    *,
    n_ctx: int = 512,
    threads: int = 0,
    backend: str | None = None,
    use_cache: bool = False,
) -> ConversionQuality:
    """Score a conversion's output against its source on `text` (default: the built-in text).

    Args:
        src, out: any two checkpoints of one model with the same tokenizer (GGUF, dense or quantized HF).
        backend: llamacpp scores both as GGUF (HF sides converted by gguf_of: losslessly, or through the exact
            dequantized weights); torch loads both HF checkpoints as the torch backend does. None: torch for a
            dense HF source and a 4/8-bit quantized HF output it runs (no GGUF or dequantized copies written:
            faster, and far less disk for a large model), llama.cpp otherwise or when torch refuses a layout.
        use_cache: keep a dense source's GGUF in the in-situ cache (llamacpp), for the next conversion of it.
    Raises:
        ConfigError: the two tokenize differently, or a side the backend cannot read.
    """
    t0 = time.perf_counter()
    size, n_params = weight_footprint(out)
    text = text or builtin_text()
    r = None
    if backend is None and _torch_runs(src, out):
        try:
            r = kl_divergence(src, out, text, n_ctx=n_ctx, threads=threads, backend="torch")
        except (ConfigError, UnsupportedFormatError) as exc:  # e.g. a layer shape no Marlin layout fits
            log.info("the torch backend cannot score %s (%s); llama.cpp scores it", out, exc.message)
        except RuntimeError as exc:  # torch's own failures, out of memory included: llama.cpp needs less
            log.info("the torch backend failed to score %s (%s); llama.cpp scores it", out, exc)
    elif backend == "torch":
        r = kl_divergence(src, out, text, n_ctx=n_ctx, threads=threads, backend="torch")
    if r is None:
        keep = []
        try:
            a, handle = gguf_of(src, use_cache=use_cache)
            keep.append(handle)
            b, handle = gguf_of(out, use_cache=False)  # the cache is for sources a later run may read again
            keep.append(handle)
            r = kl_divergence(a, b, text, n_ctx=n_ctx, threads=threads)
        finally:
            for handle in keep:
                if handle is not None:
                    handle.cleanup()
    return ConversionQuality(
        size_bytes=size,
        bits_per_weight=size * 8 / n_params if n_params else 0.0,
        ppl_source=r.ppl_base,
        ppl_output=r.ppl_model,
        mean_kl=r.mean_kl,
        seconds=time.perf_counter() - t0,
        top1_agreement=r.top1_agreement,
        n_scored=r.n_scored,
        scored_by=r.scored_by,
    )


def _torch_runs(src: Path, out: Path) -> bool:
    """A dense HF source and a quantized HF output whose architecture and bits the torch backend runs."""
    from quantserve.backends.torch.archs import runs
    from quantserve.formats import detect

    s, o = detect(src), detect(out)
    arch = next(iter((o.config or {}).get("architectures") or []), None)
    return (
        s.format == "safetensors"
        and o.scheme is not None
        and runs(arch)
        and o.scheme.weights()[0] in (4, 8)  # Marlin's
    )
