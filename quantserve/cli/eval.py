"""`quantserve eval ppl|kl`: perplexity and KL divergence of a model on a text, scored by llama.cpp or torch."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
from tqdm import tqdm

from quantserve.cli.common import fail
from quantserve.errors import QuantserveError, require_torch


def _path(model: str, models_file: str | None) -> Path:
    """MODEL as a path, or the models.toml entry of that name."""
    from quantserve.registry import find_models_toml, load_registry, resolve

    path = Path(model)
    return path if path.exists() else resolve(model, load_registry(find_models_toml(models_file))).path


def gguf_for(model: str, models_file: str | None) -> Path:
    """A GGUF for MODEL: a path or models.toml name; dense checkpoints are converted (and cached) as by `run`,
    quantized ones through their exact dequantized weights (conversion_quality.gguf_of)."""
    from quantserve.conversion_quality import gguf_of

    gguf, handle = gguf_of(_path(model, models_file), use_cache=True)
    _KEEP.append(handle)
    return gguf


def hf_for(model: str, models_file: str | None) -> Path:
    """An HF checkpoint directory the torch backend loads for MODEL: a GGUF is converted to fp32 safetensors (its
    dequantized weights: the same numbers llama.cpp computes with) in a temporary directory."""
    from quantserve.formats import detect

    path = _path(model, models_file)
    spec = detect(path)
    if spec.format != "gguf":
        return spec.directory
    from quantserve.converters import gguf_to_hf

    tmp = tempfile.TemporaryDirectory(prefix="quantserve-eval-")
    _KEEP.append(tmp)
    return gguf_to_hf(spec.files[0], Path(tmp.name) / "hf", dtype="fp32", progress=False)


_KEEP: list = []  # temporary conversions, alive until the process ends
_FOR_BACKEND = {"llamacpp": gguf_for, "torch": hf_for}


def _shown(model: str, path: Path) -> str:
    return model if Path(model) == path else f"{model} (scored as {path})"


def _needs_torch(backend: str) -> None:
    """--backend torch without PyTorch: say so (exit 2) before any conversion is spent on it."""
    if backend == "torch":
        try:
            require_torch("scoring with --backend torch")
        except QuantserveError as exc:
            fail(exc)


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
_threads = click.option("--threads", default=0, help="CPU threads (0: 2 for llama.cpp, torch's default)")
_models = click.option("--models-file", default=None, help="models.toml for model names")
_backend = click.option(
    "--backend",
    type=click.Choice(list(_FOR_BACKEND)),
    default="llamacpp",
    show_default=True,
    help="what scores: llama.cpp (HF checkpoints converted to GGUF first, quantized ones through their exact "
    "dequantized weights) or quantserve's torch model (GGUF converted to an fp32 HF checkpoint first); the same "
    "chunks of the same tokens either way",
)


@eval_group.command("ppl")
@click.argument("model")
@_text
@_ctx
@_threads
@_models
@_backend
def ppl(model: str, text_file: str, n_ctx: int, threads: int, models_file: str | None, backend: str) -> None:
    """Perplexity of MODEL on --text, comparable with llama.cpp's llama-perplexity."""
    from quantserve.evaluate import perplexity

    text = Path(text_file).read_text(encoding="utf-8")
    _needs_torch(backend)
    path = _measure("converting", lambda _: _FOR_BACKEND[backend](model, models_file))
    r = _measure(
        "perplexity",
        lambda p: perplexity(path, text, n_ctx=n_ctx, threads=threads, progress=p, backend=backend),
    )
    click.echo(
        f"model: {_shown(model, path)}\nscored by: {r.scored_by}\nPPL = {r.ppl:.4f}  (mean NLL {r.nll:.5f}; {r.n_chunks} chunks "
        f"of {r.n_ctx}, {r.n_scored} tokens scored)"
    )


@eval_group.command("kl")
@click.option("--base", required=True, help="reference model (e.g. the full-precision one)")
@click.option(
    "--model",
    "models",
    required=True,
    multiple=True,
    help="model to compare against --base; repeat it to compare several, the base scored once",
)
@_text
@_ctx
@_threads
@_models
@_backend
def kl(
    base: str,
    models: tuple[str, ...],
    text_file: str,
    n_ctx: int,
    threads: int,
    models_file: str | None,
    backend: str,
) -> None:
    """Mean KL(base || model) and top-1 token agreement over the scored tokens of --text (all models on
    --backend)."""
    from quantserve.evaluate import kl_divergences

    text = Path(text_file).read_text(encoding="utf-8")
    _needs_torch(backend)
    a = _measure("converting", lambda _: _FOR_BACKEND[backend](base, models_file))
    paths = [_measure("converting", lambda _, m=m: _FOR_BACKEND[backend](m, models_file)) for m in models]
    results = _measure(
        "KL divergence",
        lambda p: kl_divergences(a, paths, text, n_ctx=n_ctx, threads=threads, progress=p, backend=backend),
    )
    click.echo(f"base:  {_shown(base, a)}")
    for model, path, r in zip(models, paths, results, strict=True):
        click.echo(
            f"model: {_shown(model, path)}\nscored by: {r.scored_by}\nmean KL = {r.mean_kl:.6f} nats, top-1 "
            f"agreement = {100 * r.top1_agreement:.2f}%, PPL base {r.ppl_base:.4f}, PPL model {r.ppl_model:.4f} "
            f"({r.n_scored} tokens)"
        )
