"""The `quantserve` command line: one module per command (run, models/inspect/cache, convert, eval, bench)."""

from __future__ import annotations

import click

from quantserve import __version__
from quantserve.cli.bench import bench
from quantserve.cli.convert import convert
from quantserve.cli.eval import eval_group
from quantserve.cli.models import cache, inspect, models
from quantserve.cli.rpc import rpc_worker
from quantserve.cli.serve import run


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="quantserve")
def main() -> None:
    """quantserve: serve quantized LLMs behind an OpenAI-compatible API."""


for command in (run, models, inspect, cache, convert, eval_group, bench, rpc_worker):
    main.add_command(command)
