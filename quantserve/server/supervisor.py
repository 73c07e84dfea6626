"""A model on llama.cpp RPC workers, served from a child process that this one supervises and proxies.

llama.cpp's RPC client aborts its process when a worker dies or answers badly mid-run (ggml-rpc.cpp,
RPC_STATUS_ASSERT), and no Python code can catch an abort. So with --rpc, `quantserve run` splits in two, as Ollama
runs its llama.cpp runners: this process listens, answers /healthz and /readyz, and forwards every other request to
a child that serves the model (the ordinary server, on a Unix socket of its own). When the child dies:
- a streaming response in flight ends with its API's own error event, naming the worker that is gone;
- new requests get 503 in their API's shape, naming it, and /readyz turns 503;
- the workers are greeted every RETRY_S seconds, and once all answer the child starts again and loads the model.

A request that gets no byte from the child for --rpc-timeout seconds counts as a hung worker (one that stopped
answering without closing its connection): the child is killed, and the same happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from quantserve.core.rpc import Endpoint, WorkerError, check_workers, hello
from quantserve.server.errors import (
    ANTHROPIC_ROUTES,
    OLLAMA_ROUTES,
    anthropic_error_body,
    error_body,
    error_response,
)
from quantserve.server.settings import ServerSettings

log = logging.getLogger("quantserve.server")

CHILD_ENV = "QUANTSERVE_SUPERVISED"  # JSON {"socket": path, "settings": {...}}: this process is the child
RETRY_S = 2.0  # between greetings of the workers while the model is down
GREET_S = 2.0  # a greeting's timeout
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
_STREAMS = ("text/event-stream", "application/x-ndjson")


def stream_error(path: str, message: str, events_sent: int) -> bytes:
    """The API's own error event, for a stream the model stopped in the middle of."""
    if path.startswith(ANTHROPIC_ROUTES):
        return (
            b"event: error\ndata: "
            + json.dumps(anthropic_error_body(message, "api_error")).encode()
            + b"\n\n"
        )
    if path.startswith(OLLAMA_ROUTES):
        return json.dumps({"error": message}).encode() + b"\n"
    if path.startswith("/v1/responses"):
        body = {
            "type": "error",
            "sequence_number": events_sent,
            **error_body(message, "server_error")["error"],
        }
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    return b"data: " + json.dumps(error_body(message, "server_error")).encode() + b"\n\ndata: [DONE]\n\n"


class Supervisor:
    """Runs the child, knows whether it is ready and, when it is not, why."""

    def __init__(self, settings: ServerSettings, workers: tuple[Endpoint, ...]):
        self.settings = settings
        self.workers = workers
        self.folder = tempfile.mkdtemp(prefix="quantserve-rpc-")
        self.socket = str(Path(self.folder) / "model.sock")
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = False
        self.reason = "the model is loading"
        self.code = "model_loading"
        self.down = asyncio.Event()  # set while no child serves
        self.fatal: int | None = None  # the exit code when the model cannot load at all
        self.stderr_tail: deque[str] = deque(maxlen=30)
        self.restarts = 0
        self._task: asyncio.Task | None = None

    def start(self, on_fatal) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(on_fatal))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._kill(grace=self.settings.graceful_timeout)
        with contextlib.suppress(OSError):
            os.unlink(self.socket)
            os.rmdir(self.folder)

    async def _kill(self, grace: float = 0.0) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM if grace else signal.SIGKILL)
        try:
            await asyncio.wait_for(proc.wait(), timeout=grace or 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def hung(self, why: str) -> None:
        """A request saw no byte for --rpc-timeout: the child is stuck on a worker; kill it and restart."""
        if self.ready:
            log.error("the model process is stuck (%s); killing it", why)
            self.reason = f"the model stopped answering ({why})"
            await self._kill()

    async def _run(self, on_fatal) -> None:
        env = dict(os.environ)
        env[CHILD_ENV] = json.dumps({"socket": self.socket, "settings": self.settings.model_dump()})
        env.setdefault(
            "GGML_NO_BACKTRACE", "1"
        )  # an abort prints its reason, not a gdb session, and dies at once
        while True:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "quantserve.server.supervisor",
                env=env,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C in the terminal reaches this process, which stops the child
            )
            relay = asyncio.get_running_loop().create_task(self._relay(self.proc))
            waiter = asyncio.get_running_loop().create_task(self.proc.wait())
            became_ready = await self._wait_ready(waiter)
            rc = await waiter
            await relay
            self.ready = False
            self.down.set()
            if not became_ready and rc == 2:  # the child refused the model (its error is in the log above)
                self.reason, self.code, self.fatal = "the model failed to load", "model_load_failed", 2
                on_fatal()
                return
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            self.reason = await asyncio.to_thread(self._diagnose, how)
            self.code = "rpc_worker_unavailable"
            log.error("model unavailable: %s", self.reason)
            while True:  # the workers are greeted until every one answers, then the model loads again
                await asyncio.sleep(RETRY_S)
                try:
                    await asyncio.to_thread(check_workers, self.workers, GREET_S)
                    break
                except WorkerError as exc:
                    self.reason = f"{exc.message}; the model restarts once every worker answers"
            self.restarts += 1
            log.info("every RPC worker answers again; restarting the model (restart %d)", self.restarts)
            self.reason, self.code = "the model is loading again after a worker fault", "model_loading"

    def _diagnose(self, how: str) -> str:
        """Which worker is gone and why, else what the child said last."""
        gone = []
        for end in self.workers:
            try:
                hello(end, GREET_S)
            except WorkerError as exc:
                gone.append(exc.message)
        if gone:
            return "; ".join(gone) + f" (the model process was {how})"
        last = next((line for line in reversed(self.stderr_tail) if ": " in line), "")
        return f"the model process was {how}{': ' + last if last else ''}; its RPC workers answer again"

    async def _relay(self, proc: asyncio.subprocess.Process) -> None:
        """The child's log goes on to ours; its last lines are kept for the diagnosis."""
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            self.stderr_tail.append(line)
            print(line, file=sys.stderr, flush=True)

    async def _wait_ready(self, waiter: asyncio.Task) -> bool:
        transport = httpx.AsyncHTTPTransport(uds=self.socket)
        async with httpx.AsyncClient(transport=transport, base_url="http://model", timeout=5) as client:
            while not waiter.done():
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/readyz")).status_code == 200:
                        self.ready = True
                        self.down.clear()
                        log.info(
                            "the model is ready on its RPC workers (%s)", ", ".join(map(str, self.workers))
                        )
                        return True
                await asyncio.sleep(0.2)
        return False


def create_proxy(settings: ServerSettings, workers: tuple[Endpoint, ...], on_fatal) -> FastAPI:
    sup = Supervisor(settings, workers)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal client
        timeout = httpx.Timeout(connect=5.0, read=settings.rpc_timeout, write=60.0, pool=None)
        client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=sup.socket), timeout=timeout)
        sup.start(on_fatal)
        yield
        await client.aclose()
        await sup.stop()

    app = FastAPI(title="quantserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.supervisor = sup

    def unavailable(path: str) -> Response:
        message = f"model unavailable: {sup.reason}"
        return error_response(
            503, message, "server_error", code=sup.code, headers={"Retry-After": "2"}, path=path
        )

    @app.get("/healthz")
    async def health():
        return {"status": "ok"}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(request: Request, path: str):
        path = "/" + path
        if not sup.ready:
            return unavailable(path)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        upstream = client.build_request(
            request.method, "http://model" + path, params=request.query_params, headers=headers,
            content=request.stream(),
        )  # fmt: skip
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.ReadTimeout:
            await sup.hung(f"no answer in {settings.rpc_timeout:g} s")
            return unavailable(path)
        except httpx.HTTPError:
            await _settle(sup)
            return unavailable(path)
        kept = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        streaming = resp.headers.get("content-type", "").startswith(_STREAMS)
        return StreamingResponse(
            _body(resp, sup, path, streaming), status_code=resp.status_code, headers=kept
        )

    async def _body(resp: httpx.Response, sup: Supervisor, path: str, streaming: bool):
        events = 0
        try:
            async for chunk in resp.aiter_raw():
                events += chunk.count(b"\n\n")
                yield chunk
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ReadTimeout):
                await sup.hung(f"no output for {settings.rpc_timeout:g} s")
            await _settle(sup)
            if streaming:
                yield stream_error(path, f"generation failed: {sup.reason}", events)
        finally:
            await resp.aclose()

    return app


async def _settle(sup: Supervisor, wait: float = 5.0) -> None:
    """A broken connection to the child: give its death a moment to be seen and diagnosed, for the message."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(sup.down.wait(), timeout=wait)
    deadline = time.monotonic() + wait
    while sup.code == "model_loading" and not sup.ready and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # the diagnosis runs right after the child is reaped


def _watch_parent() -> None:
    """The child exits when its supervisor is gone (killed without a chance to stop it)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_main() -> int:
    """The child: the ordinary server on the supervisor's Unix socket."""
    from quantserve.errors import QuantserveError
    from quantserve.server.serve import serve

    spec = json.loads(os.environ[CHILD_ENV])
    settings = ServerSettings(**spec["settings"])
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )  # fmt: skip
    _watch_parent()
    try:
        return serve(settings, uds=spec["socket"])
    except QuantserveError as exc:
        log.error("%s", exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(child_main())
