"""`python -m quantserve.cli`, the same as the `quantserve` script.

Run as a module, Python puts the working directory first on the path; from a checkout's root that would let its
`kernels/` folder (installed as quantserve.kernels) shadow Hugging Face's `kernels`. quantserve imports nothing
from the working directory, so the entry goes, as `python -P` would drop it.
"""

import sys

if not sys.flags.safe_path:
    del sys.path[0]

from quantserve.cli import main  # noqa: E402

main()
