"""A model on llama.cpp RPC workers, served from a child process that this one supervises and proxies.

llama.cpp's RPC client aborts its process when a worker dies or answers badly mid-run (ggml-rpc.cpp,
RPC_STATUS_ASSERT), and no Python code can catch an abort. So with --rpc, `quantserve run` splits in two, as Ollama
runs its llama.cpp runners: this process listens, answers /healthz and /readyz, and forwards every other request to
a child that serves the model (the ordinary server, on a Unix socket of its own). When the child dies:
- a streaming response in flight ends with its API's own error event, naming the worker that is gone;
- new requests get 503 in their API's shape, naming it, and /readyz turns 503;
- the workers are greeted every RETRY_S seconds, and once all answer the child starts again and loads the model.

A worker that stops answering without closing its connection leaves the child's engine stuck in a step. The
supervisor reads the child's /metrics every WATCH_S seconds: an engine with work that has not finished a step for
--rpc-timeout seconds is killed, and the same happens. A first start that refuses the model itself (exit code 2,
its reason in the log) stops the server, as a model that fails to load does without --rpc; a crash loop backs off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from quantserve.core.lifeline import exit_with_parent
from quantserve.core.rpc import Endpoint, WorkerError, check_workers, hello
from quantserve.server.errors import (
    ANTHROPIC_ROUTES,
    OLLAMA_ROUTES,
    anthropic_error_body,
    error_body,
    error_response,
)
from quantserve.server.middleware import ApiKeyMiddleware
from quantserve.server.settings import ServerSettings

log = logging.getLogger("quantserve.server")

CHILD_ENV = "QUANTSERVE_SUPERVISED"  # JSON {"socket": path, "settings": {...}}: this process is the child
RETRY_S = 2.0  # between greetings of the workers while the model is down
WATCH_S = 5.0  # between looks at the child's engine progress
GREET_S = 2.0  # a greeting's timeout
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
# routes whose work runs beside the engine (no steps): the proxy bounds their wait itself
_SIDE = ("/v1/embeddings", "/v1/rerank", "/v1/score", "/api/embed", "/api/embeddings", "/rerank")
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
        fields = {k: v for k, v in error_body(message, "server_error")["error"].items() if k != "type"}
        body = {"type": "error", "sequence_number": events_sent, **fields}
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
        self.stderr_tail: deque[str] = deque(maxlen=30)
        self.restarts = 0
        self.killed: str | None = None  # why the watchdog stopped the child
        self._tasks: list[asyncio.Task] = []

    def start(self, on_fatal) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(on_fatal)), loop.create_task(self._watchdog())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._kill(grace=self.settings.graceful_timeout)
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _kill(self, grace: float = 0.0) -> None:
        """Stop the child and whatever it started (its own session: a probe, a conversion)."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM if grace else signal.SIGKILL)
        try:
            await asyncio.wait_for(proc.wait(), timeout=grace or 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def _run(self, on_fatal) -> None:
        """Start the child, wait for it to end, say why, wait for the workers, start it again."""
        env = dict(os.environ)
        env[CHILD_ENV] = json.dumps(
            {"socket": self.socket, "parent": os.getpid(), "settings": self.settings.model_dump()}
        )
        # an abort prints its reason, not a gdb session, and dies at once
        env.setdefault("GGML_NO_BACKTRACE", "1")
        failures = 0
        while True:
            try:
                became_ready, how, rc = await self._one_child(env)
                if not became_ready and rc == 2 and not self.restarts:
                    # the first start refused the model itself (its error is in the log above): as without --rpc
                    self.reason, self.code = "the model failed to load", "model_load_failed"
                    on_fatal()
                    return
                self.reason = await asyncio.to_thread(self._diagnose, how)
            except Exception as exc:  # noqa: BLE001 - supervision goes on whatever went wrong
                log.exception("the model process could not be run")
                self.reason = f"the model process could not be run: {exc}"
                became_ready = False
            self.ready = False
            self.down.set()
            self.code = "rpc_worker_unavailable"
            log.error("model unavailable: %s", self.reason)
            failures = 0 if became_ready else failures + 1
            await asyncio.sleep(min(60.0, RETRY_S * 2 ** max(0, failures - 1)))  # a crash loop backs off
            while True:  # the workers are greeted until every one answers, then the model loads again
                try:
                    await asyncio.to_thread(check_workers, self.workers, GREET_S)
                    break
                except WorkerError as exc:
                    self.reason = f"{exc.message}; the model restarts once every worker answers"
                await asyncio.sleep(RETRY_S)
            self.restarts += 1
            log.info("every RPC worker answers; starting the model again (restart %d)", self.restarts)
            self.reason, self.code = "the model is loading again after a worker fault", "model_loading"

    async def _one_child(self, env: dict[str, str]) -> tuple[bool, str, int]:
        """One child's life: (whether it became ready, how it ended, its exit code)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.proc = proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "quantserve.server.supervisor", env=env, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C in the terminal reaches this process, which stops the child
        )  # fmt: skip
        relay = asyncio.get_running_loop().create_task(self._relay(proc))
        waiter = asyncio.get_running_loop().create_task(proc.wait())
        became_ready = await self._wait_ready(waiter)
        rc = await waiter
        self.ready = False
        self.down.set()
        await relay
        try:
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        except ValueError:
            how = f"killed by signal {-rc}"
        how, self.killed = self.killed or how, None
        return became_ready, how, rc

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
        """The child's log goes on to ours, chunk by chunk (a line of any length); its last lines are kept."""
        assert proc.stderr is not None
        pending = b""
        while chunk := await proc.stderr.read(65536):
            with contextlib.suppress(
                OSError
            ):  # our stderr gone (a closed terminal): keep draining the child's
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-4096:]
            self.stderr_tail.extend(line.decode("utf-8", "replace")[:500] for line in lines)

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

    async def _watchdog(self) -> None:
        """A child whose engine has work but has not finished a step for --rpc-timeout seconds is stuck on a
        worker that stopped answering without closing its connection: kill it (the restart loop takes over)."""
        transport = httpx.AsyncHTTPTransport(uds=self.socket)
        async with httpx.AsyncClient(transport=transport, base_url="http://model", timeout=5) as client:
            last, since = -1.0, time.monotonic()
            while True:
                await asyncio.sleep(WATCH_S)
                if not self.ready:
                    last, since = -1.0, time.monotonic()
                    continue
                try:
                    busy, steps = _progress((await client.get("/metrics")).text)
                except httpx.HTTPError:  # a child that cannot answer /metrics makes no progress either
                    busy, steps = True, last
                if not busy or steps != last:
                    last, since = steps, time.monotonic()
                elif time.monotonic() - since > self.settings.rpc_timeout:
                    self.killed = f"stopped: it made no progress for {self.settings.rpc_timeout:g} s"
                    log.error("the model %s (a worker hung?); restarting it", self.killed)
                    await self._kill()


_GAUGE = re.compile(
    r"^(quantserve_(?:engine_steps|running_sequences|queue_depth))\{[^}]*\} ([0-9.e+-]+)$", re.M
)


def _progress(metrics: str) -> tuple[bool, float]:
    """(whether the engine has work, the steps it has run) from the child's /metrics."""
    values: dict[str, float] = {}
    for name, value in _GAUGE.findall(metrics):
        values[name] = values.get(name, 0.0) + float(value)
    busy = values.get("quantserve_running_sequences", 0) + values.get("quantserve_queue_depth", 0) > 0
    return busy, values.get("quantserve_engine_steps", 0.0)


def create_proxy(settings: ServerSettings, workers: tuple[Endpoint, ...], on_fatal) -> FastAPI:
    sup = Supervisor(settings, workers)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal client
        # no read timeout: a long generation is not a fault; the watchdog judges the engine's progress
        timeout = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        transport = httpx.AsyncHTTPTransport(uds=sup.socket, limits=limits)
        client = httpx.AsyncClient(transport=transport, timeout=timeout)
        sup.start(on_fatal)
        yield
        await client.aclose()
        await sup.stop()

    app = FastAPI(title="quantserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.supervisor = sup
    if settings.api_key:  # the child checks it too; here it also guards the 503s that name the workers
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)

    def unavailable(path: str) -> Response:
        message = f"model unavailable: {sup.reason}"
        return error_response(
            503, message, "server_error", code=sup.code, headers={"Retry-After": "2"}, path=path
        )

    @app.get("/health")
    @app.get("/healthz")
    async def health():
        return {"status": "ok"}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(request: Request, path: str):
        path = request.url.path
        if not sup.ready:
            return unavailable(path)
        raw = request.scope.get("raw_path") or path.encode()
        query = request.scope.get("query_string") or b""
        url = "http://model" + raw.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        has_body = (
            request.headers.get("content-length") not in (None, "0") or "transfer-encoding" in request.headers
        )
        if length := request.headers.get("content-length"):
            headers.append(("content-length", length))
        # embeddings and rerank run beside the engine, where the watchdog does not see them: a bounded wait
        side = path.startswith(_SIDE) and httpx.Timeout(5.0, read=settings.rpc_timeout)
        upstream = client.build_request(request.method, url, headers=headers,
                                        content=request.stream() if has_body else None,
                                        timeout=side or httpx.USE_CLIENT_DEFAULT)  # fmt: skip
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.ReadTimeout:
            sup.killed = f"stopped: a {path} request got no answer for {settings.rpc_timeout:g} s"
            log.error("the model %s (a worker hung?); restarting it", sup.killed)
            await sup._kill()
            await _settle(sup)
            return unavailable(path)
        except httpx.HTTPError:
            await _settle(sup)
            return unavailable(path)
        # the body passes through as its bytes: its Content-Length stays (a reply cut short then fails, not shrinks)
        drop = (_HOP - {"content-length"}) | {"date", "server"}
        kept = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in drop]
        streaming = resp.headers.get("content-type", "").startswith(_STREAMS)
        out = StreamingResponse(_body(resp, path, streaming), status_code=resp.status_code)
        out.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in kept]
        return out

    async def _body(resp: httpx.Response, path: str, streaming: bool):
        events, tail = 0, b""
        try:
            async for chunk in resp.aiter_raw():
                events += (tail + chunk).count(b"\n\n") - tail.count(b"\n\n")
                tail = chunk[-1:]
                yield chunk
        except httpx.HTTPError:
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
    exit_with_parent(spec["parent"], kernel_signal=True)  # started from the event loop's main thread
    try:
        return serve(settings, uds=spec["socket"])
    except QuantserveError as exc:
        log.error("%s", exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(child_main())
