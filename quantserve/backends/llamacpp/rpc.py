"""llama.cpp's RPC backend through the wheel's own libggml: a worker that serves this machine's device to others
(`quantserve rpc-worker`), and registering workers as devices before a model loads (`quantserve run --rpc`).

llama-cpp-python 0.3.36 ignores its `rpc_servers` argument (llama-cpp-python issue #1914), so workers are added as
llama.cpp's own `--rpc` adds them (common/arg.cpp, add_rpc_devices): the RPC registry's `ggml_backend_rpc_add_server`,
found through `ggml_backend_reg_get_proc_address`, then `ggml_backend_register`. Each worker's devices then count
as GPUs: llama.cpp puts layers on them as --n-gpu-layers and --tensor-split say, and keeps the token embeddings on
this machine.

Registration greets each worker first (quantserve.core.rpc), because the C client aborts the process on a worker it
cannot use. That covers startup only: a worker that dies while a model runs still aborts the process that loaded it,
which is why the server runs such a model in a child process (quantserve.server.supervisor).
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
from pathlib import Path

from quantserve.core.rpc import PROTOCOL, Endpoint, check_workers
from quantserve.errors import BackendUnavailableError, ConfigError

log = logging.getLogger("quantserve.llamacpp")

DEVICE_CPU, DEVICE_ACCEL = 0, 3  # enum ggml_backend_dev_type
_registered: set[Endpoint] = set()


def _lib():
    """libggml as libllama loaded it, with the registry functions typed, and the RPC registry."""
    from quantserve.backends.llamacpp.library import init_backend
    from quantserve.backends.llamacpp.offload import _ggml

    init_backend()
    lib = _ggml()  # the device functions typed there; the registry's here
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise BackendUnavailableError(
            "this llama.cpp build has no RPC backend; rebuild llama-cpp-python with -DGGML_RPC=ON (`make setup` "
            "does)"
        )
    return lib, reg


def _proc(lib, reg, name: str, restype, argtypes):
    address = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not address:
        raise BackendUnavailableError(
            f"llama.cpp's RPC backend has no {name}; this build is too old for --rpc"
        )
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def add_workers(endpoints: tuple[Endpoint, ...]) -> None:
    """Register each worker's devices with llama.cpp, once per process, after greeting them all.

    Raises:
        WorkerError: a worker is unreachable, busy or speaks another protocol version (nothing is registered).
        BackendUnavailableError: this llama.cpp has no RPC backend.
    """
    todo = tuple(e for e in endpoints if e not in _registered)
    if not todo:
        return
    check_workers(todo)
    lib, reg = _lib()
    add_server = _proc(lib, reg, "ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    for end in todo:
        worker_reg = add_server(str(end).encode())
        if not worker_reg:
            raise BackendUnavailableError(f"RPC worker {end} reports no devices")
        lib.ggml_backend_register(worker_reg)
        _registered.add(end)
        log.info(
            "RPC worker %s: %d device(s) registered (protocol %s)",
            end,
            lib.ggml_backend_reg_dev_count(worker_reg),
            ".".join(map(str, PROTOCOL)),
        )


def serve_worker(host: str, port: int, *, cache_dir: Path | None, threads: int, devices: list[str]) -> None:
    """Serve this machine's devices to RPC clients until the process is killed (rpc-server's main, in-process).

    `devices`: names as llama.cpp lists them (CPU, CUDA0, Metal, ...); none: every GPU, else the CPU, as
    rpc-server chooses.

    Raises:
        BackendUnavailableError: no RPC backend, an unknown device name, or the address cannot be bound.
    """
    lib, reg = _lib()
    by_name = {}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        by_name[lib.ggml_backend_dev_name(dev).decode()] = dev
    if devices:
        unknown = [d for d in devices if d not in by_name]
        if unknown:
            raise BackendUnavailableError(
                f"--device {','.join(unknown)}: no such device; this machine has {', '.join(by_name)}"
            )
        chosen = [by_name[d] for d in devices]
    else:
        gpus = [d for d in by_name.values() if lib.ggml_backend_dev_type(d) not in (DEVICE_CPU, DEVICE_ACCEL)]
        chosen = gpus or [d for d in by_name.values() if lib.ggml_backend_dev_type(d) == DEVICE_CPU][:1]
    start = _proc(
        lib,
        reg,
        "ggml_backend_rpc_start_server",
        None,
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)],
    )
    names = ", ".join(
        f"{lib.ggml_backend_dev_name(d).decode()} ({lib.ggml_backend_dev_description(d).decode()})"
        for d in chosen
    )
    log.info("RPC worker on %s:%d serving %s; protocol %s", host, port, names, ".".join(map(str, PROTOCOL)))
    array = (ctypes.c_void_p * len(chosen))(*chosen)
    cache = str(cache_dir).encode() if cache_dir is not None else None
    # The server loop blocks in C, where Python's signal handlers cannot run: it gets a thread of its own and the
    # main thread waits, so Ctrl-C and SIGTERM stop the worker. It returns only when it cannot accept.
    stopped = threading.Event()

    def loop() -> None:
        start(f"{host}:{port}".encode(), cache, threads, len(chosen), array)
        stopped.set()

    threading.Thread(target=loop, name="rpc-worker", daemon=True).start()
    try:
        while not stopped.wait(0.5):
            pass
    except KeyboardInterrupt:
        log.info("RPC worker on %s:%d stopped", host, port)
        return
    raise BackendUnavailableError(
        f"the RPC worker on {host}:{port} stopped: it could not start its device or accept a connection "
        "(llama.cpp's reason is printed above)"
    )


def check_bind(host: str, port: int) -> None:
    """Fail early, with a reason, where llama.cpp's worker would print one line and return: it binds only an IPv4
    address, and the port must be free.

    Raises:
        ConfigError: not an IPv4 address, or the address cannot be bound.
    """
    try:
        socket.inet_aton(host)
        if host.count(".") != 3:
            raise OSError
    except OSError:
        raise ConfigError(
            f"--host {host!r}: llama.cpp's RPC worker binds an IPv4 address, e.g. 127.0.0.1 or 0.0.0.0",
            param="host",
        ) from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp's own bind
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}", param="port") from None
