"""`quantserve rpc-worker`: lend this machine's GPU (or CPU) and memory to a quantserve elsewhere, through
llama.cpp's RPC backend."""

from __future__ import annotations

from pathlib import Path

import click

from quantserve.cli.common import fail, setup_logging
from quantserve.core.rpc import DEFAULT_PORT, is_loopback
from quantserve.errors import ConfigError, QuantserveError

RISK = (
    "llama.cpp's RPC protocol has no authentication and no encryption, and a client can make the worker read and "
    "write its memory: anyone who can reach {where} can use this machine's device and may run code on it. Use it "
    "only on a network you trust (a LAN behind a firewall, a VPN)"
)


@click.command("rpc-worker")
@click.option("--host", default="127.0.0.1", show_default=True, help="IPv4 address to listen on")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--allow-remote",
    is_flag=True,
    help="allow an address other than loopback (required for one; read the warning it prints)",
)
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="keep large tensors here, so a client that loads the same model again sends only their hashes",
)
@click.option("--threads", default=0, type=click.IntRange(0), help="CPU threads (0: all cores)")
@click.option(
    "--device",
    "devices",
    default="",
    help="llama.cpp devices to serve, comma-separated (e.g. CUDA0,CUDA1); default: every GPU, else the CPU",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def rpc_worker(
    host: str,
    port: int,
    allow_remote: bool,
    cache_dir: Path | None,
    threads: int,
    devices: str,
    log_level: str,
) -> None:
    """Serve this machine's device to `quantserve run MODEL --rpc HOST:PORT` on another machine, which then puts
    some of the model's layers here (llama.cpp's rpc-server, in-process).

    \b
    Examples:
      quantserve rpc-worker                                  # 127.0.0.1:50052, for a test on one machine
      quantserve rpc-worker --host 0.0.0.0 --allow-remote    # reachable from the LAN: read the warning
      quantserve run smollm2 --rpc 192.168.1.20:50052        # on the other machine
    """
    import logging
    import os

    from quantserve.backends.llamacpp.rpc import check_bind, serve_worker

    setup_logging(log_level)
    log = logging.getLogger("quantserve")
    try:
        if not is_loopback(host):
            if not allow_remote:
                raise ConfigError(
                    f"--host {host} would expose this machine to the network; {RISK.format(where=host)}. To do "
                    "it anyway, add --allow-remote",
                    param="host",
                )
            log.warning("listening on %s:%d. %s.", host, port, RISK.format(where=f"{host}:{port}"))
        check_bind(host, port)
        threads = threads or os.cpu_count() or 1
        serve_worker(
            host, port, cache_dir=cache_dir, threads=threads, devices=[d for d in devices.split(",") if d]
        )
    except QuantserveError as exc:
        fail(exc)
