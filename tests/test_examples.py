"""The examples run as a user would run them, against the real model."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def _run(name: str, env: dict | None = None) -> str:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_library_example():
    out = _run("library.py")
    assert "Paris" in out and out.count("- ") == 2


def test_client_examples(server):
    env = {"QUANTSERVE_URL": server.base_url}
    assert "completion tokens]" in _run("openai_client.py", env)
    assert "'city'" in _run("json_output.py", env)
