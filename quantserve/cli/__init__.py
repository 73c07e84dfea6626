"""The `quantserve` command line: one module per command (run, models/inspect/cache, convert, eval, bench)."""

from __future__ import annotations

import click

from quantserve import __version__
from quantserve.cli.bench import bench
from quantserve.cli.convert import convert
from quantserve.cli.eval import eval_group
from quantserve.cli.models import cache, inspect, models, pull
from quantserve.cli.rpc import rpc_worker
from quantserve.cli.serve import run


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="quantserve")
def main() -> None:
    """quantserve: serve quantized LLMs behind an OpenAI-compatible API."""


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell's completion script for quantserve (click's own).

    \b
    Examples:
      eval "$(quantserve completion bash)"          # in ~/.bashrc
      eval "$(quantserve completion zsh)"           # in ~/.zshrc
      quantserve completion fish > ~/.config/fish/completions/quantserve.fish
    """
    from click.shell_completion import get_completion_class

    script = get_completion_class(shell)(main, {}, "quantserve", "_QUANTSERVE_COMPLETE")
    click.echo(script.source())


for command in (run, pull, models, inspect, cache, convert, eval_group, bench, rpc_worker, completion):
    main.add_command(command)
