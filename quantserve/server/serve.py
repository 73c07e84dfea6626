"""serve(settings): validate the model, then run uvicorn with a graceful SIGTERM shutdown. Returns the exit code."""

from __future__ import annotations

import logging
import signal

import uvicorn

from quantserve import __version__
from quantserve.server.settings import ServerSettings

log = logging.getLogger("quantserve")


def serve(settings: ServerSettings, *, uds: str | None = None) -> int:
    """Blocks until SIGINT/SIGTERM. On a signal the server stops accepting connections, lets in-flight requests
    finish for up to `graceful_timeout` seconds, cancels the rest, and returns 0. In single-model mode a model that
    fails to load stops the server with exit code 2; in router mode it answers 503 and the server goes on.

    With RPC workers (--rpc, or the models.toml entry's `rpc`), the model runs in a child process behind this
    one (quantserve.server.supervisor); `uds` is that child's Unix socket, given only to the child.

    Raises:
        QuantserveError: the model cannot be found or its file is invalid (checked before listening); an RPC
            worker is unreachable or of another version.
    """
    from quantserve.core.rpc import check_workers, parse_endpoints
    from quantserve.errors import ConfigError
    from quantserve.server.app import create_app
    from quantserve.server.catalog import prepare
    from quantserve.server.supervisor import create_proxy

    rpc = None
    if settings.router_mode:
        if settings.model is not None:
            raise ConfigError(
                f"give a MODEL ({settings.model}) or --models ({settings.models}), not both", param="models"
            )
        prepared = prepare(settings)  # models.toml, read once
        registry = prepared.registry
        assert registry is not None
        with_rpc = [name for name, e in registry.entries.items() if e.rpc] + (
            ["--rpc"] if settings.rpc else []
        )
        if with_rpc:
            raise ConfigError(
                f"{', '.join(with_rpc)}: a model on RPC workers is served alone, in a process of its own that a "
                f"worker fault cannot take down; run it with `quantserve run NAME`",
                param="rpc",
            )
        split = [n for n, e in registry.entries.items() if (e.tensor_parallel_size or 1) > 1]
        if split or settings.tensor_parallel_size > 1:
            raise ConfigError(
                f"{', '.join(split) or '--tensor-parallel-size'}: a tensor-parallel model is served alone (its ranks "
                "hold the process's one process group); run it with `quantserve run NAME`",
                param="tensor_parallel_size",
            )
        log.info(
            "quantserve %s: router mode, models from %s", __version__, settings.models_file or "models.toml"
        )
    else:
        router_only = {
            "--models-max": settings.models_max,
            "--memory-budget": settings.memory_budget,
            "--keep-alive": settings.keep_alive,
        }
        given = [flag for flag, value in router_only.items() if value]
        if given:
            raise ConfigError(
                f"{', '.join(given)}: for router mode only (several models); with one MODEL nothing unloads. "
                f"Drop them, or serve models.toml's entries: quantserve run --models {settings.model}",
                param="models",
            )
        # the plan validates the files (before llama.cpp ever opens them) and the settings, before listening;
        # the first load carries it out
        prepared = prepare(settings)
        assert prepared.model is not None
        resolved, plan = prepared.model.resolved, prepared.model.plan
        rpc = settings.rpc or resolved.entry.rpc
        if rpc and plan.backend != "llamacpp":
            raise ConfigError(
                f"--rpc puts llama.cpp's layers on other machines, and {resolved.name} runs on the {plan.backend} "
                "backend; add --backend llamacpp, or drop --rpc",
                param="rpc",
            )
        log.info(
            "quantserve %s: model %s -> %s (%s, backend %s)",
            __version__,
            resolved.name,
            resolved.path,
            plan.spec.format,
            plan.backend,
        )

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_load_error() -> None:
        nonlocal exit_code
        exit_code = 2
        if server is not None:
            server.should_exit = True

    if rpc and uds is None:
        workers = parse_endpoints(rpc)
        check_workers(workers)  # a worker the C client would abort on is refused here, by name
        log.info("RPC workers %s answer; the model runs in a child process", ", ".join(map(str, workers)))
        app = create_proxy(settings, workers, on_load_error)
    else:
        app = create_app(
            settings, prepared=prepared, on_load_error=None if settings.router_mode else on_load_error
        )
    where = {"uds": uds} if uds else {"host": settings.host, "port": settings.port}
    config = uvicorn.Config(
        app,
        **where,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.graceful_timeout,
        access_log=settings.log_level == "debug",
    )
    server = uvicorn.Server(config)
    if uds:
        server.run()
        return exit_code
    log.info(
        "OpenAI-compatible API on http://%s:%d/v1, chat page on http://%s:%d/ (%s)",
        settings.host,
        settings.port,
        settings.host,
        settings.port,
        "models load on their first request; GET /v1/models lists them"
        if settings.router_mode
        else "GET /ready turns 200 once the model is loaded",
    )
    # uvicorn restores the handlers it found and then re-raises the signal it caught, which would kill us with
    # -SIGTERM after a clean shutdown. Handlers that ignore it make a graceful stop exit with our own code (0).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return exit_code
