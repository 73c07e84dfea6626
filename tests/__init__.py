"""quantserve's tests.

Importing this package takes the repository root off `sys.path`. The root is no place to import from: its
`kernels/` and `converters/` install as `quantserve.kernels` and `quantserve.converters`, and on the path they would
shadow Hugging Face's `kernels`, which transformers imports. `python -m pytest`, and a bench script that imports
from `tests`, put the root first; pytest itself imports with `--import-mode=importlib` (pyproject.toml), and once
this package is loaded, `tests.*` resolves through it.
"""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
