"""The repository's top-level kernels/ and converters/ shadow no installed package, in tests or in the CLI.

They install as quantserve.kernels and quantserve.converters; `kernels` at the top level is Hugging Face's package,
which transformers 5.25 and later import (transformers.activations). With the checkout's root on sys.path, as
`python -m pytest` or `python -m quantserve.cli` from the root would put it, `import kernels` found our folder and
every test that touched transformers failed to import.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _theirs() -> None:
    if importlib.util.find_spec("kernels") is None:
        pytest.skip("Hugging Face's kernels is not installed (the dev extra installs it)")


def test_import_kernels_in_the_test_process_is_hugging_faces():
    _theirs()
    import kernels

    assert not kernels.__spec__.origin.startswith(str(ROOT / "kernels")), kernels.__spec__.origin
    assert hasattr(kernels, "get_kernel")
    assert all(Path(p or ".").resolve() != ROOT for p in sys.path)


def test_transformers_gemma2_imports():
    _theirs()
    import transformers

    assert transformers.Gemma2ForCausalLM.__name__ == "Gemma2ForCausalLM"


@pytest.mark.parametrize("module", ["quantserve.cli", "quantserve"])
def test_the_cli_run_as_a_module_from_the_root_imports_nothing_from_it(module):
    """`python -m quantserve.cli` (or `python -m quantserve`) from the root: the working directory is off the path
    before anything imports."""
    code = (  # as `python -m` runs it: the working directory first on the path
        "import os, runpy, sys; sys.path[0] = os.getcwd(); sys.argv = ['quantserve', '--help']\n"
        f"try: runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit: pass\n"
        "import kernels; print('KERNELS', kernels.__spec__.origin)"
    )
    _theirs()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("KERNELS ")]
    assert str(ROOT / "kernels") not in line, line
