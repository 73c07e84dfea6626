"""`python -m quantserve.cli`, the same as the `quantserve` script."""

from quantserve.cli import main

main()
