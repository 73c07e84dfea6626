"""What every command shares: the exit code for a user's mistake, how it is printed, and logging."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

import click

from quantserve.errors import QuantserveError

EXIT_USER_ERROR = 2


def fail(exc: QuantserveError) -> NoReturn:
    click.echo(f"error: {exc.message}", err=True)
    sys.exit(EXIT_USER_ERROR)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
