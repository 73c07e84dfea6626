"""Open WebUI against quantserve as its Ollama endpoint: it lists the models and completes a chat.

Open WebUI (PyPI `open-webui`) and its dependencies take about 3 GB (torch, chromadb, onnxruntime, opencv, …),
too much for `make test`, so this check runs by hand, in a venv of its own, and writes its result to
bench/results/. It drives Open WebUI through its own HTTP API (the one its web page calls), not a browser:

    python3.11 -m venv /tmp/owui && /tmp/owui/bin/pip install torch==2.13.0 open-webui
    .venv/bin/python bench/openwebui.py --open-webui /tmp/owui/bin/open-webui [--model smollm2]

Steps: start `quantserve run MODEL`; start `open-webui serve` offline with OLLAMA_BASE_URL pointing at it and the
OpenAI connection off; sign up the first user (the admin); GET /api/models; POST /api/chat/completions, streamed
and not; check that quantserve's log shows Open WebUI's requests on /api/ routes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from serving import free_port  # noqa: E402

QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def wait_for(url: str, proc: subprocess.Popen, log: Path, seconds: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if proc.poll() is not None:
            sys.exit(f"{url}: the process exited with {proc.returncode}; its log:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} not up after {seconds:.0f} s; the log:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open-webui", required=True, help="the open-webui executable of its own venv")
    ap.add_argument("--model", default="smollm2", help="what quantserve serves (models.toml name or path)")
    ap.add_argument("--out", type=Path, default=ROOT / f"bench/results/openwebui-{date.today()}.md")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="owui-check-"))
    qs_port, ui_port = free_port(), free_port()
    qs_log, ui_log = tmp / "quantserve.log", tmp / "open-webui.log"
    qs = subprocess.Popen(
        [sys.executable, "-m", "quantserve.cli", "run", args.model, "--port", str(qs_port), "--log-level", "debug"],
        stdout=qs_log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    env = {
        **os.environ,
        "DATA_DIR": str(tmp / "data"),
        "OLLAMA_BASE_URL": f"http://127.0.0.1:{qs_port}",
        "ENABLE_OLLAMA_API": "True",
        "ENABLE_OPENAI_API": "False",
        "WEBUI_SECRET_KEY": "quantserve-check",
        "OFFLINE_MODE": "True",  # no model downloads, no version check
        "HF_HUB_OFFLINE": "1",
        "ENABLE_VERSION_UPDATE_CHECK": "False",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
        "ENABLE_TITLE_GENERATION": "False",  # background tasks that would also ask the model
        "ENABLE_TAGS_GENERATION": "False",
        "ENABLE_FOLLOW_UP_GENERATION": "False",
        "ANONYMIZED_TELEMETRY": "False",
        "DO_NOT_TRACK": "True",
    }
    (tmp / "data").mkdir()
    ui = subprocess.Popen(
        [args.open_webui, "serve", "--host", "127.0.0.1", "--port", str(ui_port)],
        stdout=ui_log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp, env=env, start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        wait_for(f"http://127.0.0.1:{qs_port}/ready", qs, qs_log, 120)
        ui_start = wait_for(f"http://127.0.0.1:{ui_port}/health", ui, ui_log, 600)
        base = f"http://127.0.0.1:{ui_port}"
        version = httpx.get(base + "/api/version", timeout=10).json().get("version")
        r = httpx.post(base + "/api/v1/auths/signup", timeout=60,
                       json={"name": "check", "email": "check@example.com", "password": "check-password-1"})  # fmt: skip
        r.raise_for_status()
        auth = {"Authorization": f"Bearer {r.json()['token']}"}
        models = httpx.get(base + "/api/models", headers=auth, timeout=60).json()["data"]
        ids = [m["id"] for m in models]
        ollama_ids = [m["id"] for m in models if m.get("owned_by") == "ollama"]
        assert ollama_ids, f"Open WebUI lists no Ollama model: {json.dumps(models)[:2000]}"
        model = ollama_ids[0]
        t0 = time.monotonic()
        r = httpx.post(base + "/api/chat/completions", headers=auth, timeout=300,
                       json={"model": model, "messages": QUESTION, "stream": False, "temperature": 0})  # fmt: skip
        r.raise_for_status()
        answer = r.json()["choices"][0]["message"]["content"]
        chat_s = time.monotonic() - t0
        streamed = ""
        with httpx.stream("POST", base + "/api/chat/completions", headers=auth, timeout=300,
                          json={"model": model, "messages": QUESTION, "stream": True, "temperature": 0}) as s:  # fmt: skip
            s.raise_for_status()
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:]).get("choices", [{}])[0].get("delta", {})
                    streamed += delta.get("content") or ""
        log = qs_log.read_text(errors="replace").splitlines()  # debug level: uvicorn's access log is on
        served = [ln for ln in log if '"POST /api/chat' in ln]
        listed = [ln for ln in log if '"GET /api/tags' in ln]
        ok = "paris" in answer.lower() and "paris" in streamed.lower() and served
        lines = [
            f"# Open WebUI against quantserve's Ollama API ({date.today()})",
            "",
            f"- result: **{'passed' if ok else 'FAILED'}**",
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            f"- Open WebUI {version} (PyPI open-webui, its own venv), driven through its HTTP API (the one its web "
            "page calls), not a browser",
            f"- quantserve serves `{args.model}` (llama.cpp backend, CPU); Open WebUI's only connection is Ollama "
            f"at OLLAMA_BASE_URL, the OpenAI one is off; Open WebUI took {ui_start:.0f} s to start",
            f"- GET /api/models listed {ids} (Ollama's: {ollama_ids})",
            f"- POST /api/chat/completions with {model!r}, not streamed, {chat_s:.1f} s: {answer!r}",
            f"- the same, streamed: {streamed!r}",
            f"- quantserve's access log: {len(listed)} GET /api/tags and {len(served)} POST /api/chat from Open "
            f"WebUI, e.g. `{served[0].strip() if served else ''}`",
            "",
            "Command: `.venv/bin/python bench/openwebui.py --open-webui /tmp/owui/bin/open-webui`",
        ]
        args.out.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        if not ok:
            sys.exit(1)
    finally:
        stop(ui)
        stop(qs)


if __name__ == "__main__":
    main()
