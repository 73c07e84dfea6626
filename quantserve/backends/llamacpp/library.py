"""llama.cpp's process-wide state: the backend initialised once, its log routed into Python logging."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import llama_cpp as lc

log = logging.getLogger("quantserve.llamacpp")

# ggml_log_level: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT. llama.cpp is chatty at INFO, so that becomes DEBUG here.
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}


@lc.llama_log_callback
def _log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if text:
        line = text.decode("utf-8", "replace").rstrip()
        # where the weights went (which device, RPC worker or host buffer holds how much) is worth a line at load
        where = logging.INFO if "model buffer size" in line else logging.DEBUG
        log.log(max(_LOG_LEVELS.get(level, logging.DEBUG), where), "%s", line)


_backend_ready = False
_mtmd_ready = False


def init_backend() -> None:
    """Initialise llama.cpp once per process, with its log routed to Python logging; call before any model load."""
    global _backend_ready
    if not _backend_ready:
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


def init_mtmd_log() -> None:
    """Route libmtmd's log (its own, apart from llama.cpp's) the same way; call before loading a projector."""
    global _mtmd_ready
    if not _mtmd_ready:
        import llama_cpp.mtmd_cpp as mtmd

        mtmd.mtmd_log_set(_log_callback, ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(_log_callback, ctypes.c_void_p(0))
        _mtmd_ready = True


_LIBGGML = ("libggml.so.0", "libggml.0.dylib", "libggml.dylib", "ggml.dll", "libggml.so")


def libggml() -> ctypes.CDLL:
    """libggml as libllama loaded it: the file its dependency names (libggml.so.0 on Linux). The wheel installs
    libggml.so and libggml.so.0 as two copies of one file, and llama_cpp._ggml opens the other one, whose device
    registry libllama never reads: a device registered there (an RPC worker) would be invisible to a model."""
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in _LIBGGML:
        if (libdir / name).exists():
            return ctypes.CDLL(str(libdir / name))
    raise OSError(f"no libggml in {libdir}")
