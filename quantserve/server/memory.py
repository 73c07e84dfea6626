"""What memory is free, and sizes as users write them: with a plan's estimate (ModelPlan.memory_bytes), the
router's basis for unloading models to make room (--memory-budget)."""

from __future__ import annotations

import psutil


def free_bytes(backend: str) -> int | None:
    """Memory a new model can use now: the GPU's free memory for the torch backend on CUDA, else the OS's
    available memory as psutil reads it on each OS (Linux's MemAvailable: free plus reclaimable page cache;
    macOS's free plus inactive pages; Windows' available physical memory). None where it cannot be told."""
    if backend == "torch":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.mem_get_info()[0]
        except ImportError:
            pass
    try:
        return int(psutil.virtual_memory().available)
    except OSError:  # e.g. a container without /proc mounted, on Linux
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
