"""Configured by environment, and called from a browser on another origin: a real `quantserve run` on SmolLM2 given
its API key and --allowed-origins through QUANTSERVE_* variables, and pages served from two other ports in
Debian's headless Chromium, one allowed and one not. The browser sends a CORS preflight (the Authorization header
makes the request non-simple), then the call."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.fixtures.static_server import StaticServer
from tests.server.test_chat_page import browser, needs_browser  # noqa: F401 - the fixture, shared

KEY = "env-s3cret"
PAGE = """<!doctype html><title>page</title><pre id="out">waiting</pre><script>
fetch("%s/v1/chat/completions", {method: "POST",
  headers: {"Authorization": "Bearer %s", "Content-Type": "application/json"},
  body: JSON.stringify({messages: [{role: "user", content: "Say hi"}], max_tokens: 4, temperature: 0})})
 .then(r => r.json()).then(j => { out.textContent = "ok " + JSON.stringify(j.usage); })
 .catch(e => { out.textContent = "refused " + e; });
</script>"""


@pytest.fixture(scope="module")
def env_server(tmp_path_factory):
    """Served by environment variables alone; one page's origin allowed, the other's not."""
    pages = StaticServer(), StaticServer()
    env = {"QUANTSERVE_API_KEY": KEY, "QUANTSERVE_ALLOWED_ORIGINS": pages[0].origin}
    srv = start_server(tmp_path_factory.mktemp("cors"), "smollm2", "--max-num-seqs", "2", env=env)
    for page in pages:
        page.body = (PAGE % (srv.base_url, KEY)).encode()
    srv.pages = pages
    yield srv
    assert srv.stop() == 0
    for page in pages:
        page.close()


def test_the_key_comes_from_the_environment_and_is_on_no_command_line(env_server):
    assert httpx.get(env_server.base_url + "/v1/models").status_code == 401
    ok = httpx.get(env_server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    cmdline = Path(f"/proc/{env_server.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline and b"--api-key" not in cmdline


def test_preflight_answers_only_the_allowed_origin(env_server):
    allowed, refused = (page.origin for page in env_server.pages)
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    url = env_server.base_url + "/v1/chat/completions"
    yes = httpx.options(url, headers={"Origin": allowed, **ask})
    assert yes.status_code == 200 and yes.headers["access-control-allow-origin"] == allowed
    no = httpx.options(url, headers={"Origin": refused, **ask})
    assert no.status_code == 400 and "access-control-allow-origin" not in no.headers


@needs_browser
def test_a_page_on_an_allowed_origin_calls_the_api_and_another_is_refused(env_server, browser):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    results = []
    for page in env_server.pages:
        browser.get(page.origin + "/")
        WebDriverWait(browser, 120).until(lambda d: d.find_element(By.ID, "out").text != "waiting")
        results.append(browser.find_element(By.ID, "out").text)
    allowed, refused = results
    assert allowed.startswith("ok ") and json.loads(allowed[3:])["completion_tokens"] >= 1, allowed
    assert refused.startswith("refused TypeError"), refused  # what fetch() says when CORS refuses
