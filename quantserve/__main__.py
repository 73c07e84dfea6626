"""`python -m quantserve`, the same as the `quantserve` script: it runs `python -m quantserve.cli`, whose module
also takes the working directory off the path (see there)."""

import runpy

runpy.run_module("quantserve.cli", run_name="__main__", alter_sys=True)
