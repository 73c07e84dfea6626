"""`quantserve run`: serve a model; one command-line option per ServerSettings field."""

from __future__ import annotations

import sys
import types
import typing

import click

from quantserve.cli.common import fail, setup_logging
from quantserve.errors import ConfigError, QuantserveError


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
        # Each setting also reads QUANTSERVE_<NAME> (click's envvar; the command line wins): how services and
        # containers configure a server, and a way to give --api-key that `ps` does not show.
        env = {"envvar": f"QUANTSERVE_{name.upper()}", "show_envvar": True}
        if base is bool:
            flag = opt if name.startswith("no_") else f"{opt}/--no-{opt[2:]}"
            func = click.option(flag, name, is_flag=True, default=None, help=field.description, **env)(func)
            continue
        if typing.get_origin(base) is typing.Literal:
            ptype = click.Choice(typing.get_args(base))
        else:
            ptype = {int: int, float: float, str: str}.get(base, str)
        default_txt = f" [default: {field.default}]" if field.default not in (None, "") else ""
        help_text = f"{field.description}{default_txt}"
        func = click.option(opt, name, type=ptype, default=None, help=help_text, **env)(func)
    return func


@click.command()
@click.argument("model", required=False)
@_settings_options
def run(model: str | None, **options) -> None:
    """Serve MODEL (a models.toml name, a path or a hub id) on an OpenAI-compatible HTTP API, with a chat page
    at /. Without MODEL (or with --models), router mode: every models.toml entry (or those named) is served, each
    loaded on its first request; --models-max and --memory-budget unload the least recently used.

    \b
    Examples:
      quantserve run smollm2                        # one model, loaded at startup
      quantserve run path/to/model.gguf --ctx-size 4096 --max-num-seqs 4
      quantserve run smollm2 --port 8080 --api-key secret
      quantserve run                                # router mode: all of models.toml
      quantserve run --models smollm2,coder --models-max 1 --keep-alive 10m
    """
    from pydantic import ValidationError

    from quantserve.server.serve import serve
    from quantserve.server.settings import ServerSettings

    try:
        settings = ServerSettings(model=model, **{k: v for k, v in options.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else None  # (none: several fields')
        fail(ConfigError(f"{flag}: {msg}" if flag else msg))
    setup_logging(settings.log_level)
    try:
        _torchrun_rank(settings)
        code = serve(settings)
    except QuantserveError as exc:
        fail(exc)
    sys.exit(code)


def _torchrun_rank(settings) -> None:
    """Under torchrun, every process but rank 0 runs its slice of the model and never serves HTTP: it exits when
    rank 0 stops. Rank 0 goes on to serve."""
    import os

    if int(os.environ.get("RANK") or 0) == 0 or settings.router_mode:
        return  # (torch is not imported for anything else)
    resolved, engine = settings.resolve_model()
    engine = engine.for_model(resolved.entry)  # its size may come from models.toml
    if engine.torch.tensor_parallel_size < 2:
        return
    from quantserve.backends.torch.tp import run_rank, torchrun_rank
    from quantserve.formats import detect

    rank = torchrun_rank()
    if rank is None:
        return
    world, addr, port = (
        int(os.environ["WORLD_SIZE"]),
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
    )
    sys.exit(run_rank(detect(resolved.path), engine, rank, world, addr, port))
