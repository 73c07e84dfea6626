"""The `quantserve` command line: run, models, inspect."""

from __future__ import annotations

import logging
import sys
import types
import typing
from pathlib import Path

import click

from quantserve import __version__
from quantserve.errors import QuantserveError

EXIT_USER_ERROR = 2


def _fail(exc: QuantserveError) -> typing.NoReturn:
    click.echo(f"error: {exc.message}", err=True)
    sys.exit(EXIT_USER_ERROR)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


def _settings_options(func):
    """One --option per ServerSettings field, typed and documented from the field itself."""
    from quantserve.server.settings import ServerSettings

    for name, field in reversed(list(ServerSettings.model_fields.items())):
        if name == "model":
            continue
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        base = args[0] if isinstance(ann, types.UnionType) and len(args) == 1 else ann
        opt = "--" + name.replace("_", "-")
        if base is bool:
            flag = opt if name.startswith("no_") else f"{opt}/--no-{opt[2:]}"
            func = click.option(flag, name, is_flag=True, default=None, help=field.description)(func)
            continue
        if typing.get_origin(base) is typing.Literal:
            ptype = click.Choice(typing.get_args(base))
        else:
            ptype = {int: int, float: float, str: str}.get(base, str)
        default_txt = f" [default: {field.default}]" if field.default not in (None, "") else ""
        help_text = f"{field.description}{default_txt}"
        func = click.option(opt, name, type=ptype, default=None, help=help_text)(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="quantserve")
def main() -> None:
    """quantserve: serve quantized LLMs behind an OpenAI-compatible API."""


@main.command()
@click.argument("model", required=False)
@_settings_options
def run(model: str | None, **options) -> None:
    """Serve MODEL (a models.toml name, a path or a hub id; default: models.toml's default) on an
    OpenAI-compatible HTTP API.

    \b
    Examples:
      quantserve run                       # the default model (SmolLM2-135M-Instruct)
      quantserve run path/to/model.gguf --ctx-size 4096 --max-num-seqs 4
      quantserve run smollm2 --port 8080 --api-key secret
    """
    from quantserve.server.serve import serve
    from quantserve.server.settings import ServerSettings

    settings = ServerSettings(model=model, **{k: v for k, v in options.items() if v is not None})
    _setup_logging(settings.log_level)
    try:
        code = serve(settings)
    except QuantserveError as exc:
        _fail(exc)
    sys.exit(code)


@main.command()
@click.option("--models-file", default=None, help="models.toml to read (default: ./models.toml)")
def models(models_file: str | None) -> None:
    """List the models named in models.toml."""
    from quantserve.registry import find_models_toml, load_registry

    try:
        reg = load_registry(find_models_toml(models_file))
    except QuantserveError as exc:
        _fail(exc)
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


@main.command()
@click.argument("model")
@click.option("--models-file", default=None, help="models.toml to read (default: ./models.toml)")
def inspect(model: str, models_file: str | None) -> None:
    """Describe MODEL (a path, or a models.toml name): format, architecture, parameters, quantization per
    tensor class, bits per weight, size, context length, chat template, and which backends can serve it."""
    from quantserve.formats import render_summary, summarize
    from quantserve.registry import find_models_toml, load_registry, resolve

    try:
        path = Path(model)
        if not path.exists():
            path = resolve(model, load_registry(find_models_toml(models_file))).path
        click.echo(render_summary(summarize(path)))
    except QuantserveError as exc:
        _fail(exc)


@main.group()
def cache() -> None:
    """The in-situ quantization cache (models converted by `run --quant`)."""


@cache.command("ls")
@click.option(
    "--cache-dir", default=None, help="cache directory (default: $QUANTSERVE_CACHE or ~/.cache/quantserve)"
)
def cache_ls(cache_dir: str | None) -> None:
    """List cached conversions with their sizes."""
    from quantserve.quant_cache import QuantCache

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
    from quantserve.quant_cache import QuantCache

    qc = QuantCache(Path(cache_dir) if cache_dir else None)
    targets = [e.key for e in qc.entries()] if remove_all else list(keys)
    if not targets:
        raise click.UsageError("name the keys to remove (see `quantserve cache ls`), or pass --all")
    for key in targets:
        if not qc.remove(key):
            click.echo(f"error: no cache entry {key!r}", err=True)
            sys.exit(EXIT_USER_ERROR)
        click.echo(f"removed {key}")


def _register_subcommands() -> None:
    from quantserve.bench_cmd import bench
    from quantserve.convert_cmd import convert
    from quantserve.eval_cmd import eval_group

    main.add_command(bench)
    main.add_command(convert)
    main.add_command(eval_group)


_register_subcommands()

if __name__ == "__main__":
    main()
