"""Models by name from a hub, against a local stand-in for it (tests/fixtures/hub.py; these machines reach no hub):
`run org/X-GGUF:Q4_1` fetches only that file and serves it, `pull` shows its progress, a cached model runs with
HF_HUB_OFFLINE=1 without asking the hub anything, and an uncached one, or a type the repository lacks, fails with a
message that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import PARIS, ROOT, start_server
from tests.fixtures.hub import LocalHub

REPO = "org/SmolLM2-GGUF"
Q4_1 = "SmolLM2-135M-Instruct-Q4_1.gguf"


@pytest.fixture(scope="module")
def hub(smollm2_gguf, tmp_path_factory):
    junk = tmp_path_factory.mktemp("hub") / "q8"
    junk.write_bytes(b"GGUF not really")  # never to be fetched
    readme = junk.with_name("README.md")
    readme.write_text("# SmolLM2 GGUF\n")
    hub = LocalHub({REPO: {Q4_1: smollm2_gguf, "SmolLM2-135M-Instruct-Q8_0.gguf": junk, "README.md": readme}})
    yield hub
    hub.close()


def _env(hub: LocalHub, home, offline: bool = False) -> dict[str, str]:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env["HF_HUB_OFFLINE"] = "1" if offline else "0"
    return env


def _pull(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quantserve", "pull", *args], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, **env}, timeout=120,
    )  # fmt: skip


def test_run_by_tag_fetches_that_file_only_then_runs_offline(hub, tmp_path):
    home = tmp_path / "hf"
    srv = start_server(tmp_path, f"{REPO}:Q4_1", "--ctx-size", "1024", env=_env(hub, home))
    try:
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            json={"messages": PARIS, "max_tokens": 16, "temperature": 0},
            timeout=60,
        )
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        assert srv.stop() == 0
    assert dict(hub.gets) == {f"{REPO}/{Q4_1}": 1}  # not the Q8_0, not the README
    before = hub.requests
    srv = start_server(tmp_path, f"{REPO}:Q4_1", "--ctx-size", "1024", env=_env(hub, home, offline=True))
    try:
        assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"] == f"{REPO}:Q4_1"
    finally:
        assert srv.stop() == 0
    assert hub.requests == before  # offline: the hub was not asked anything


def test_pull_shows_progress_and_prints_the_path(hub, tmp_path):
    # huggingface_hub draws its bars on a terminal only; TQDM_POSITION=-1 is its switch to draw them anyway
    r = _pull(f"hf.co/{REPO}:q4_1", env={**_env(hub, tmp_path / "hf"), "TQDM_POSITION": "-1"})
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert path.endswith(Q4_1) and os.path.getsize(path) > 50_000_000
    assert "100%" in r.stderr and Q4_1 in r.stderr  # huggingface_hub's progress bar for the file


def test_what_cannot_be_pulled_says_why(hub, tmp_path):
    r = _pull(f"{REPO}:Q5_K_M", env=_env(hub, tmp_path / "hf"))
    assert (
        r.returncode == 2 and "has no Q5_K_M GGUF; it has Q4_1, Q8_0; run org/SmolLM2-GGUF:Q4_1" in r.stderr
    )
    r = _pull(f"{REPO}:Q4_1", env=_env(hub, tmp_path / "empty", offline=True))
    assert r.returncode == 2 and "is not in the Hugging Face cache" in r.stderr and "offline" in r.stderr
    r = _pull("org/no-such-repo", env=_env(hub, tmp_path / "hf"))
    assert r.returncode == 2 and "could not fetch 'org/no-such-repo' from the hub" in r.stderr
