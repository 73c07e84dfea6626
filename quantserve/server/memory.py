"""What memory is free, and sizes as users write them: with a plan's estimate (ModelPlan.memory_bytes), the
router's basis for unloading models to make room (--memory-budget)."""

from __future__ import annotations

import os
from pathlib import Path


def free_bytes(backend: str) -> int | None:
    """Memory a new model can use now: the GPU's free memory for the torch backend on CUDA, else the OS's
    available memory (Linux's MemAvailable: free plus reclaimable page cache). None where it cannot be told."""
    if backend == "torch":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.mem_get_info()[0]
        except ImportError:
            pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def parse_size(text: str) -> int:
    """'24G', '512M', '1.5GiB', '1000000': bytes (K/M/G/T are powers of 1024).

    Raises:
        ValueError: not a size.
    """
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if t and t[-1] in "KMGT":
        scale, t = 2 ** (10 * ("KMGT".index(t[-1]) + 1)), t[:-1]
    value = float(t)
    if not value > 0:
        raise ValueError(text)
    return int(value * scale)
