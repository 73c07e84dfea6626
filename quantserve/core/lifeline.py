"""A child process that must not outlive the process that started it (a tensor-parallel rank, the model behind an
RPC supervisor): it exits within a second of its parent being gone."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time


def exit_with_parent(parent: int, *, kernel_signal: bool = False) -> None:
    """Exit when the process `parent` is no longer this one's parent (checked every second, from now).

    `kernel_signal`: also ask Linux for SIGTERM the moment it goes (PR_SET_PDEATHSIG). Only where the child was
    started from the parent's main thread: the signal fires when the starting *thread* ends."""
    if kernel_signal:
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
