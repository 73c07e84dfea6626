"""Serving smoke test: `quantserve run MODEL --backend torch` as a user starts it, the Paris question through the
official `openai` client, then a short `quantserve bench` at 1 and 8 clients. Writes one JSON.

    python bench/gpu/serve_smoke.py --out serve.json [--model DIR] [-- extra run options]

Without --model it serves the staged SmolLM2 GPTQ (bench/gpu/stage.py), unpacked under the system temp folder.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

PARIS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


def parser() -> argparse.ArgumentParser:
    """The command line (tests/bench/test_gpu_script.py parses bench/gpu/run.py's commands with it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON result")
    ap.add_argument("--model", default=None, help="model to serve (default: the staged SmolLM2 GPTQ)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per bench request (default 64)")
    ap.add_argument("--requests", type=int, default=None, help="bench requests per level (default: bench's)")
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("run_args", nargs="*", help="after --: extra `quantserve run` options")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    out = Path(args.out)
    result: dict = {"ok": False}
    if args.model is None:
        from stage import StageError, assemble

        try:
            args.model = str(assemble(Path(tempfile.gettempdir()) / "quantserve-gpu-model"))
        except StageError as exc:
            result["error"] = f"no model to serve: {exc}"
            out.write_text(json.dumps(result, indent=1) + "\n")
            print(result["error"])
            return 3
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "quantserve.cli",
        "run",
        args.model,
        "--backend",
        "torch",
        "--port",
        str(port),
    ]
    cmd += args.run_args
    result.update(model=args.model, command="quantserve " + " ".join(cmd[3:]))
    log_path = out.with_suffix(".server.log")
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    try:
        result["ready_s"] = round(wait_ready(url, proc, args.ready_timeout), 1)
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        t0 = time.monotonic()
        model_id = client.models.list().data[0].id
        r = client.chat.completions.create(model=model_id, messages=PARIS, temperature=0, max_tokens=32)
        answer = r.choices[0].message.content or ""
        result.update(answer=answer, answer_s=round(time.monotonic() - t0, 2), paris="Paris" in answer)
        print(f"answer ({result['answer_s']} s): {answer!r}", flush=True)
        bench_json = out.with_suffix(".bench.json")
        bench = [sys.executable, "-m", "quantserve.cli", "bench", "--url", url, "-c", "1", "-c", "8",
                 "--max-tokens", str(args.max_tokens), "--json", str(bench_json)]  # fmt: skip
        if args.requests:
            bench += ["-n", str(args.requests)]
        subprocess.run(bench, cwd=ROOT, check=True, timeout=600)
        doc = json.loads(bench_json.read_text())
        result["bench"] = [
            {
                k: run.get(k)
                for k in ("concurrency", "num_ok", "num_errors", "agg_tok_s", "ttft_p50_ms", "tpot_p50_ms")
            }
            for run in doc["runs"]
        ]
        result["bench_settings"] = doc["settings"]
        result["ok"] = result["paris"] and all(run["num_errors"] == 0 for run in result["bench"])
    except Exception as exc:  # noqa: BLE001 - the report says what went wrong; the server is stopped below
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(result["error"], flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        result["server_rc"] = proc.returncode
        result["server_log_tail"] = log_path.read_text(errors="replace").splitlines()[-20:]
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
