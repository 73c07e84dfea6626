"""`quantserve models`, `inspect` and `cache`: what is configured, what a model file holds, what is cached."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from quantserve.cli.common import EXIT_USER_ERROR, fail
from quantserve.errors import QuantserveError


@click.command()
@click.option("--models-file", default=None, help="models.toml to read (default: ./models.toml)")
def models(models_file: str | None) -> None:
    """List the models named in models.toml."""
    from quantserve.registry import find_models_toml, load_registry

    try:
        reg = load_registry(find_models_toml(models_file))
    except QuantserveError as exc:
        fail(exc)
    if not reg.entries:
        click.echo("no models.toml found; pass --models-file or create ./models.toml")
        return
    click.echo(f"# {reg.path}")
    width = max(len(n) for n in reg.entries) + 2
    for name in reg.names():
        e = reg.entries[name]
        mark = " (default)" if name == reg.default else ""
        extras = [f"quant={e.quant}"] if e.quant else []
        extras += [f"aliases={','.join(e.aliases)}"] if e.aliases else []
        click.echo(f"{name:<{width}}{e.source}{mark}  {' '.join(extras)}".rstrip())


@click.command()
@click.argument("model")
@click.option("--models-file", default=None, help="models.toml to read (default: ./models.toml)")
@click.option("--backend", default=None, help="as `quantserve run --backend`: auto, llamacpp or torch")
@click.option(
    "--quant", default=None, help="as `quantserve run --quant`: a GGUF type or int4, applied at load"
)
@click.option("--ctx-size", type=int, default=None, help="as `quantserve run --ctx-size`")
@click.option("--max-num-seqs", type=int, default=None, help="as `quantserve run --max-num-seqs`")
@click.option(
    "--tensor-parallel-size", type=int, default=None, help="as `quantserve run --tensor-parallel-size`"
)
@click.option(
    "--chat-template", default=None, help="a Jinja file: what the model would get with this template"
)
def inspect(model: str, models_file: str | None, **flags) -> None:
    """Describe MODEL (a path, or a models.toml name): its files (format, architecture, parameters, quantization
    per tensor class, bits per weight, size, trained context), then its plan: what `quantserve run MODEL` with the
    same flags would do, and why (backend, conversion steps, context, KV cache, chat template, tool-call format,
    capabilities, vision)."""
    from quantserve.core.settings import EngineSettings
    from quantserve.formats import render_summary, summarize
    from quantserve.llm import LLM
    from quantserve.registry import find_models_toml, load_registry, resolve

    try:
        resolved = resolve(model, load_registry(find_models_toml(models_file)))
        settings = EngineSettings.from_options(**{k: v for k, v in flags.items() if v is not None})
        plan = LLM.plan_for(resolved, settings)
        click.echo(render_summary(summarize(plan.spec), tuple(plan.rows())))
    except QuantserveError as exc:
        fail(exc)


@click.command()
@click.argument("model")
@click.option("--models-file", default=None, help="models.toml to read (default: ./models.toml)")
def pull(model: str, models_file: str | None) -> None:
    """Fetch MODEL from the Hugging Face hub into its cache ahead of `run`, with progress: a hub id (org/name), a
    GGUF repository with the type to take (org/name:Q4_K_M; without one, Q4_K_M or its first type), or a models.toml
    name whose source is on the hub. Prints the local path. HF_HOME, HF_ENDPOINT and HF_TOKEN are huggingface_hub's.

    \b
    Examples:
      quantserve pull bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M
      quantserve pull HuggingFaceTB/SmolLM2-135M-Instruct     # safetensors and configs
    """
    from quantserve.registry import find_models_toml, load_registry, resolve

    try:
        resolved = resolve(model, load_registry(find_models_toml(models_file)))
    except QuantserveError as exc:
        fail(exc)
    click.echo(str(resolved.path))


@click.group()
def cache() -> None:
    """The in-situ quantization cache (models converted by `run --quant`)."""


@cache.command("ls")
@click.option(
    "--cache-dir", default=None, help="cache directory (default: $QUANTSERVE_CACHE or ~/.cache/quantserve)"
)
def cache_ls(cache_dir: str | None) -> None:
    """List cached conversions with their sizes."""
    from quantserve.insitu.cache import QuantCache

    qc = QuantCache(Path(cache_dir) if cache_dir else None)
    entries = qc.entries()
    click.echo(f"# {qc.root}")
    for e in entries:
        click.echo(f"{e.key}  {e.size / 1e6:9.1f} MB  {e.quant:<8} {e.source}")
    click.echo(f"{len(entries)} entries, {sum(e.size for e in entries) / 1e6:.1f} MB")


@cache.command("rm")
@click.argument("keys", nargs=-1)
@click.option("--all", "remove_all", is_flag=True, help="remove every entry")
@click.option(
    "--cache-dir", default=None, help="cache directory (default: $QUANTSERVE_CACHE or ~/.cache/quantserve)"
)
def cache_rm(keys: tuple[str, ...], remove_all: bool, cache_dir: str | None) -> None:
    """Remove cached conversions by KEY (see `cache ls`), or --all."""
    from quantserve.insitu.cache import QuantCache

    qc = QuantCache(Path(cache_dir) if cache_dir else None)
    targets = [e.key for e in qc.entries()] if remove_all else list(keys)
    if not targets:
        raise click.UsageError("name the keys to remove (see `quantserve cache ls`), or pass --all")
    for key in targets:
        if not qc.remove(key):
            click.echo(f"error: no cache entry {key!r}", err=True)
            sys.exit(EXIT_USER_ERROR)
        click.echo(f"removed {key}")
