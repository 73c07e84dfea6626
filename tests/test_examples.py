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
    assert "tool call: get_weather(" in out


def test_client_examples(server):
    env = {"QUANTSERVE_URL": server.base_url}
    assert "completion tokens]" in _run("openai_client.py", env)
    assert "'city'" in _run("json_output.py", env)


def test_readme_examples(server, tmp_path):
    """The README's Python blocks, in order and as written, against the session's server (its port for 8000): the
    OpenAI chat, Responses, Anthropic and Ollama calls each print the answer."""
    import re

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks).replace("http://127.0.0.1:8000", server.base_url))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    answers = r.stdout.strip().splitlines()
    assert len(answers) == 4 and all("Paris" in a for a in answers), (
        r.stdout
    )  # greedy: each as the README says
