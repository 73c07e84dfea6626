"""llama.cpp's RPC workers as seen from Python: endpoints parsed and checked, and each worker asked for its protocol
version before llama.cpp's own client connects to it.

The C client aborts the whole process when a worker is unreachable, speaks another protocol version or answers
badly (ggml-rpc.cpp: GGML_ABORT in its connect and RPC_STATUS_ASSERT). So quantserve greets each worker itself
first, with the protocol's own first message, and refuses one that would make the C client abort, by name.

The protocol (ggml/src/ggml-rpc/ggml-rpc.cpp in the llama.cpp sources): a request is a command byte, a little-endian
u64 length and that many bytes; an answer is a u64 length and its bytes. The first request must be HELLO (command 14)
carrying 24 bytes of transport capabilities (zeros: plain TCP); the answer is major, minor, patch, one byte of
padding and the worker's 24 capability bytes. A client accepts a worker whose major equals its own and whose minor
is not above its own. A worker serves one client at a time: a greeting to a worker that is serving someone else
waits in its queue, so it times out instead.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

from quantserve.errors import BackendUnavailableError, ConfigError

# RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of the llama.cpp this quantserve builds (ggml/include/ggml-rpc.h);
# tests/backends/llamacpp/test_rpc.py checks it against a worker started from the wheel.
PROTOCOL = (7, 0, 0)
HELLO = 14
CAPS = 24  # RPC_CONN_CAPS_SIZE (ggml-rpc/transport.h)
DEFAULT_PORT = 50052  # rpc-server's


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str | list[str] | tuple[str, ...]) -> tuple[Endpoint, ...]:
    """`host:port[,host:port...]` as llama-server's --rpc takes it. llama.cpp's client resolves the host itself;
    its worker binds only an IPv4 address.

    Raises:
        ConfigError: an empty list, a missing or bad port, the same worker twice, or more than 16 workers
            (GGML_RPC_MAX_SERVERS).
    """
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    found: list[Endpoint] = []
    for raw in (s.strip() for s in items):
        host, sep, port = raw.partition(":")  # as the C client splits it: at the first colon
        if not sep or not host or "[" in host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"--rpc {raw!r}: give each worker as host:port, e.g. 192.168.1.20:{DEFAULT_PORT} (llama.cpp's RPC "
                "client speaks IPv4 only)",
                param="rpc",
            )
        end = Endpoint(host, int(port))
        if end in found:
            raise ConfigError(f"--rpc lists {end} twice; give each worker once", param="rpc")
        found.append(end)
    if not found:
        raise ConfigError("--rpc: no workers given; write host:port[,host:port...]", param="rpc")
    if len(found) > 16:
        raise ConfigError(f"--rpc lists {len(found)} workers; llama.cpp takes at most 16", param="rpc")
    return tuple(found)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class WorkerError(BackendUnavailableError):
    """A worker that cannot be used: unreachable, busy, silent or of another protocol version (503 to a client:
    the model is there, its worker is not)."""

    http_status = 503

    def __init__(self, endpoint: Endpoint, reason: str):
        super().__init__(f"RPC worker {endpoint} {reason}")
        self.endpoint = endpoint
        self.reason = reason


def hello(endpoint: Endpoint, timeout: float = 3.0) -> tuple[int, int, int]:
    """The worker's protocol version, from the protocol's greeting; the connection is closed after it.

    Raises:
        WorkerError: nothing listens there, no answer within `timeout` (a worker serving another client answers
            only once that client leaves), or an answer that is not the greeting's.
    """
    try:
        # the C client resolves the host to IPv4 and tries its first address only: so does this
        family, kind, proto, _, address = socket.getaddrinfo(endpoint.host, endpoint.port, socket.AF_INET,
                                                             socket.SOCK_STREAM)[0]  # fmt: skip
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
            sock.sendall(struct.pack("<BQ", HELLO, CAPS) + bytes(CAPS))
            answer = _recv(sock, 8)
            (size,) = struct.unpack("<Q", answer)
            if size != 4 + CAPS:
                raise WorkerError(
                    endpoint,
                    f"answered the greeting with {size} bytes, not {4 + CAPS}: is it a llama.cpp RPC worker?",
                )
            major, minor, patch = _recv(sock, size)[:3]
    except TimeoutError:
        raise WorkerError(
            endpoint,
            f"did not answer within {timeout:g} s (it serves one client at a time: is "
            "another server using it?)",
        ) from None
    except ConnectionRefusedError:
        raise WorkerError(
            endpoint,
            "refused the connection: no worker listens there; start one with "
            f"`quantserve rpc-worker --port {endpoint.port}` on that machine",
        ) from None
    except socket.gaierror as exc:
        raise WorkerError(endpoint, f"cannot be resolved to an IPv4 address: {exc.strerror or exc}") from None
    except OSError as exc:
        raise WorkerError(endpoint, f"is unreachable: {exc.strerror or exc}") from None
    return major, minor, patch


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the worker closed the connection")
        data += chunk
    return data


def compatible(version: tuple[int, int, int], ours: tuple[int, int, int] = PROTOCOL) -> bool:
    """The C client's rule: the same major version, and a minor version not above the client's."""
    return version[0] == ours[0] and version[1] <= ours[1]


def check_workers(endpoints: tuple[Endpoint, ...], timeout: float = 3.0) -> None:
    """Greet every worker; refuse the first that llama.cpp's client would abort on.

    Raises:
        WorkerError: unreachable, silent, or of a protocol version this llama.cpp cannot speak (both named).
    """
    for end in endpoints:
        version = hello(end, timeout)
        if not compatible(version):
            theirs, ours = ".".join(map(str, version)), ".".join(map(str, PROTOCOL))
            raise WorkerError(
                end,
                f"speaks llama.cpp RPC protocol {theirs}, and this quantserve's llama.cpp speaks {ours}: run the "
                "same quantserve version (or a llama.cpp rpc-server of the same protocol) on every machine",
            )
