"""llama.cpp's process-wide state: the backend initialised once, its log routed into Python logging."""

from __future__ import annotations

import ctypes
import logging

import llama_cpp as lc

log = logging.getLogger("quantserve.llamacpp")

# ggml_log_level: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT. llama.cpp is chatty at INFO, so that becomes DEBUG here.
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}


@lc.llama_log_callback
def _log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if text:
        log.log(_LOG_LEVELS.get(level, logging.DEBUG), "%s", text.decode("utf-8", "replace").rstrip())


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
