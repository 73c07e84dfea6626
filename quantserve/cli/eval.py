"""`quantserve eval ppl|kl`: perplexity and KL divergence of GGUF (or in-situ converted) models on a text."""

from __future__ import annotations

from pathlib import Path

import click
from tqdm import tqdm

from quantserve.cli.common import fail
from quantserve.errors import QuantserveError


def gguf_for(model: str, models_file: str | None) -> Path:
    """A GGUF for MODEL: a path or models.toml name; dense checkpoints are converted (and cached) as by `run`."""
    from quantserve.formats import detect
    from quantserve.registry import find_models_toml, load_registry, resolve

    path = Path(model)
    if not path.exists():
        path = resolve(model, load_registry(find_models_toml(models_file))).path
    spec = detect(path)
    if spec.format == "gguf":
        return spec.files[0]
    if spec.format == "safetensors":
        from quantserve.insitu import ensure_gguf

        return ensure_gguf(spec, None, cache_dir=None, use_cache=True)[0]
    if spec.scheme is not None:
        # Scored by the same llama.cpp code as every GGUF: the exact dequantized weights, as an f32 GGUF.
        import tempfile

        from quantserve.insitu import ensure_gguf
        from quantserve.quant.dequantize import dequantize_checkpoint

        with tempfile.TemporaryDirectory(
            prefix="quantserve-eval-"
        ) as tmp:  # the dense copy goes once converted
            dense = dequantize_checkpoint(path, Path(tmp) / "dense", dtype="float32")
            gguf, handle = ensure_gguf(detect(dense), "f32", cache_dir=None, use_cache=False)
        _KEEP.append(handle)
        return gguf
    raise QuantserveError(f"{path} is {spec.format}; eval reads GGUF, dense and quantized HF checkpoints")


_KEEP: list = []  # temporary GGUF conversions, alive until the process ends


def _measure(desc: str, score):
    """Run `score(progress)` under a progress bar; a user error prints its message and exits 2."""
    bar = tqdm(desc=desc, unit="chunk", leave=False)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        return score(progress)
    except QuantserveError as exc:
        fail(exc)
    finally:
        bar.close()


@click.group("eval")
def eval_group() -> None:
    """Measure model quality on a text (llama-perplexity's conventions)."""


_text = click.option(
    "--text",
    "text_file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="UTF-8 text to score (at least 2 x --ctx tokens)",
)
_ctx = click.option(
    "--ctx", "n_ctx", default=512, show_default=True, help="chunk length; half of each is scored"
)
_threads = click.option("--threads", default=0, help="CPU threads (0: 2)")
_models = click.option("--models-file", default=None, help="models.toml for model names")


@eval_group.command("ppl")
@click.argument("model")
@_text
@_ctx
@_threads
@_models
def ppl(model: str, text_file: str, n_ctx: int, threads: int, models_file: str | None) -> None:
    """Perplexity of MODEL on --text, comparable with llama.cpp's llama-perplexity."""
    from quantserve.evaluate import perplexity

    text = Path(text_file).read_text(encoding="utf-8")
    gguf = _measure("converting", lambda _: gguf_for(model, models_file))
    r = _measure("perplexity", lambda p: perplexity(gguf, text, n_ctx=n_ctx, threads=threads, progress=p))
    click.echo(
        f"model: {gguf}\nPPL = {r.ppl:.4f}  (mean NLL {r.nll:.5f}; {r.n_chunks} chunks of {r.n_ctx}, "
        f"{r.n_scored} tokens scored)"
    )


@eval_group.command("kl")
@click.option("--base", required=True, help="reference model (e.g. the full-precision one)")
@click.option("--model", "model", required=True, help="model to compare against --base")
@_text
@_ctx
@_threads
@_models
def kl(base: str, model: str, text_file: str, n_ctx: int, threads: int, models_file: str | None) -> None:
    """Mean KL(base || model) and top-1 token agreement over the scored tokens of --text."""
    from quantserve.evaluate import kl_divergence

    text = Path(text_file).read_text(encoding="utf-8")
    a = _measure("converting", lambda _: gguf_for(base, models_file))
    b = _measure("converting", lambda _: gguf_for(model, models_file))
    r = _measure(
        "KL divergence", lambda p: kl_divergence(a, b, text, n_ctx=n_ctx, threads=threads, progress=p)
    )
    click.echo(
        f"base:  {a}\nmodel: {b}\nmean KL = {r.mean_kl:.6f} nats, top-1 agreement = "
        f"{100 * r.top1_agreement:.2f}%, PPL base {r.ppl_base:.4f}, PPL model {r.ppl_model:.4f} "
        f"({r.n_scored} tokens)"
    )
