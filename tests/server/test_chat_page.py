"""The chat page at /: served without the API key, and driven in Debian's headless Chromium (Selenium) against a
real `quantserve run` on SmolLM2: models, streaming, stop, storage, errors, and model text kept as text."""

from __future__ import annotations

import importlib.util
import json
import os
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from quantserve.server.app import create_app
from quantserve.server.settings import ServerSettings
from tests.conftest import ROOT, start_server

STATIC = ROOT / "quantserve" / "server" / "static"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
KEY = "page-s3cret"
XSS = "<img src=x onerror=alert(1)>"
PARIS_Q = "What is the capital of France?"


def _browser_missing() -> str | None:
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} not found: install Debian's chromium and chromium-driver (`make setup` does where apt-get works)"
    return None


needs_browser = pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing()))


# ---- served files, no browser ----------------------------------------------------------------------


def test_page_and_its_files_are_served_without_the_api_key():
    client = TestClient(create_app(ServerSettings(api_key=KEY)))  # no lifespan: no model loads
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/static/chat.js"' in page.text
    assert client.get("/static/chat.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/chat.css").headers["content-type"].startswith("text/css")
    assert client.get("/static/settings.py").status_code == 404
    assert client.get("/v1/models").status_code == 401  # the API itself still needs the key
    assert client.get("/favicon.ico").status_code == 204  # what a browser asks for on /health's JSON page


def test_page_files_ship_as_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for path in STATIC.iterdir():
        rel = path.relative_to(ROOT / "quantserve")
        assert any(rel.match(p) for p in patterns["quantserve"]), f"{rel} is not in pyproject's package-data"


def test_script_never_parses_text_as_html():
    js = (STATIC / "chat.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "eval("):
        assert sink not in js


# ---- in the browser --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    reason = _browser_missing()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: selenium-manager is never asked to find or download one.
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def chat_server(browser, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("chat"), "smollm2", "--max-num-seqs", "2", "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture()
def page(browser, chat_server):
    return Page(browser, chat_server.base_url)


class Page:
    """The chat page in the browser, with the waits and DOM reads the tests share."""

    def __init__(self, driver, base_url: str):
        self.d, self.base_url = driver, base_url

    def open(self, *, key: str | None = KEY, settings: dict | None = None, conversations=None, current=None):
        """Load / with localStorage set first, from another page of the same origin (so the page's own script
        never sees the old state), and drop the console messages of earlier tests."""
        self.d.get(self.base_url + "/health")
        store = {
            "quantserve.apiKey": key,
            "quantserve.settings": settings,
            "quantserve.conversations": conversations,
            "quantserve.current": current,
        }
        self.d.execute_script(
            "localStorage.clear();"
            "for (const [k, v] of Object.entries(arguments[0])) if (v !== null) localStorage.setItem(k, v);",
            {k: json.dumps(v) for k, v in store.items() if v is not None},
        )
        self.console()
        self.d.get(self.base_url + "/")

    def wait(self, cond, timeout: float = 60, message: str = ""):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.d, timeout, poll_frequency=0.02).until(lambda d: cond(), message)

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def by_id(self, id_: str):
        from selenium.webdriver.common.by import By

        return self.d.find_element(By.ID, id_)

    def models(self) -> list[str]:
        return self.js("return [...document.querySelectorAll('#model option')].map(o => o.value)")

    def wait_models(self) -> list[str]:
        self.wait(lambda: self.models(), 30, "the model list stayed empty")
        return self.models()

    def ask(self, text: str) -> None:
        from selenium.webdriver.common.keys import Keys

        self.by_id("input").send_keys(text, Keys.ENTER)

    def busy(self) -> bool:
        return self.by_id("stop").is_displayed()

    def wait_idle(self, timeout: float = 60) -> None:
        self.wait(
            lambda: not self.busy() and self.by_id("send").is_displayed(), timeout, "the reply never ended"
        )

    def texts(self, role: str) -> list[str]:
        return self.js(
            "return [...document.querySelectorAll(`#messages .msg.${arguments[0]} .body`)].map(b => b.textContent)",
            role,
        )

    def titles(self) -> list[str]:
        return self.js(
            "return [...document.querySelectorAll('#conversations .title')].map(b => b.textContent)"
        )

    def console(self) -> list[dict]:
        """The browser's console since the last call (reading it empties it)."""
        return self.d.get_log("browser")

    def errors(self, allow: str | None = None) -> list[dict]:
        return [e for e in self.console() if e["level"] == "SEVERE" and not (allow and allow in e["message"])]

    def no_alert(self) -> bool:
        from selenium.common.exceptions import NoAlertPresentException

        try:
            self.d.switch_to.alert  # noqa: B018 - the property raises when no alert is open
        except NoAlertPresentException:
            return True
        return False


def _idle_on_server(base_url: str, timeout: float = 10) -> None:
    """No sequence running, and every KV cell held is prefix cache: the server let go of the request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = {}
        for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            m[name.partition("{")[0]] = value  # one model: its series only
        if (
            float(m["quantserve_running_sequences"]) == 0
            and m["quantserve_kv_cells_used"] == m["quantserve_kv_cells_cached"]
        ):
            return
        time.sleep(0.1)
    raise AssertionError("the server still runs the request the page stopped")


@needs_browser
def test_page_asks_for_the_key_and_then_lists_the_model(page):
    page.open(key=None)
    page.wait(lambda: page.by_id("error").is_displayed(), 10, "no error shown for the 401")
    assert "API key" in page.by_id("error-text").text
    assert page.by_id("settings").is_displayed()
    assert page.models() == []
    page.by_id("api-key").send_keys(KEY, "\t")
    assert page.wait_models() == ["smollm2"]
    assert not page.by_id("error").is_displayed()
    assert page.js("return localStorage.getItem('quantserve.apiKey')") == json.dumps(KEY)
    assert page.errors(allow="401") == []  # the browser logs the refused request itself


@needs_browser
def test_page_loads_without_console_errors_and_lists_the_model(page):
    page.open()
    assert page.wait_models() == ["smollm2"]
    time.sleep(0.3)  # anything late (a 404 for an icon, a script error) is in the log by now
    assert page.errors() == []
    assert not page.by_id("error").is_displayed()
    assert page.by_id("system").get_attribute("value") == "You are a helpful assistant."


@needs_browser
def test_typed_question_gets_a_streamed_answer(page):
    page.open(settings={"temperature": "0", "max_tokens": "160"})
    page.wait_models()
    # Every length the reply in flight has had: more than a couple means it was drawn as it streamed in.
    page.js(
        "window.lengths = [];"
        "new MutationObserver(() => {"
        "  const b = document.querySelector('#messages .msg.assistant.pending .body');"
        "  if (b) window.lengths.push(b.textContent.length);"
        "}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});"
    )
    page.ask("Write a Python function that adds two numbers.")
    assert page.busy()
    page.wait_idle()
    (answer,) = page.texts("assistant")
    assert answer.strip()
    assert page.texts("user") == ["Write a Python function that adds two numbers."]
    lengths = [n for n in page.js("return window.lengths") if n > 0]
    assert len(set(lengths)) >= 3, lengths
    assert page.titles()[0].startswith("Write a Python function")
    assert page.errors() == []
    # docs/serving.md's screenshot; off by default, so that a test run leaves the tree clean.
    if os.environ.get("QUANTSERVE_SCREENSHOT") == "1":
        page.by_id("settings-toggle").click()
        page.d.set_window_size(1280, 1000)
        page.js("document.getElementById('messages').scrollTop = 0")
        page.d.save_screenshot(str(ROOT / "docs" / "chat-page.png"))
        page.d.set_window_size(1280, 800)


@needs_browser
def test_stop_cancels_the_reply_and_the_server_lets_go(page, chat_server):
    page.open(settings={"max_tokens": "3000"})
    page.wait_models()
    page.ask("Tell me a very long story about a dragon who learns to sail, in many chapters.")
    page.wait(lambda: (page.texts("assistant") or [""])[-1].strip(), 30, "no text came")
    page.by_id("stop").click()
    page.wait_idle(5)
    stopped = page.texts("assistant")[-1]
    assert page.js("return document.querySelector('#messages .msg.assistant .note').textContent") == "stopped"
    _idle_on_server(
        chat_server.base_url
    )  # the browser closed the connection; the server aborted and freed KV
    time.sleep(0.5)
    assert page.texts("assistant")[-1] == stopped
    assert page.by_id("send").is_enabled() and not page.by_id("stop").is_displayed()
    page.ask(PARIS_Q)
    page.wait_idle()
    assert page.texts("assistant")[-1].strip()
    assert page.errors() == []


@needs_browser
def test_conversations_new_rename_delete_survive_a_reload(page):
    old = {
        "id": "old",
        "title": "Old chat",
        "system": "",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    }
    page.open(settings={"temperature": "0", "max_tokens": "24"}, conversations=[old], current="old")
    page.wait_models()
    assert page.texts("assistant") == ["hello"]
    page.by_id("new-chat").click()
    assert page.texts("user") == []
    page.ask(PARIS_Q)
    page.wait_idle()
    answer = page.texts("assistant")
    assert answer[0].strip()
    assert page.titles()[0].startswith(PARIS_Q)

    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    page.d.find_element(By.CSS_SELECTOR, "#conversations li.current .rename").click()
    editor = page.d.find_element(By.CSS_SELECTOR, "#conversations li input")
    editor.send_keys(Keys.CONTROL, "a")
    editor.send_keys("Capital", Keys.ENTER)
    delete = page.d.find_elements(By.CSS_SELECTOR, "#conversations li .delete")[1]  # Old chat's
    delete.click()
    page.d.find_elements(By.CSS_SELECTOR, "#conversations li .delete")[1].click()  # now "Delete?"

    page.d.refresh()
    page.wait_models()
    assert page.titles() == ["Capital"]
    assert page.texts("user") == [PARIS_Q]
    assert page.texts("assistant") == answer
    assert page.errors() == []


@needs_browser
def test_pasted_markup_in_a_question_stays_text(page):
    page.open(settings={"temperature": "0", "max_tokens": "16"})
    page.wait_models()
    page.ask(XSS)
    page.wait_idle()
    assert page.texts("user") == [XSS]
    assert XSS in page.by_id("messages").text  # visible, as written
    assert page.js("return document.querySelectorAll('#messages img').length") == 0
    assert page.no_alert()
    assert (
        page.errors() == []
    )  # an <img src=x> would have logged its failed load; a blocked handler, a CSP error


@needs_browser
def test_stored_reply_with_markup_renders_as_text_and_code_as_code(page):
    reply = f"Here it is:\n```python\nprint('<b>hi</b>')\n```\n{XSS} and `<i>x</i>`"
    conv = {
        "id": "xss",
        "title": "<script>alert(2)</script>",
        "system": "",
        "messages": [
            {"role": "user", "content": "Show me some markup."},
            {
                "role": "assistant",
                "content": reply,
                "tool_calls": [
                    {
                        "function": {
                            "name": "<img src=y onerror=alert(3)>",
                            "arguments": '{"q": "<svg onload=alert(4)>"}',
                        }
                    }
                ],
            },
        ],
    }
    page.open(conversations=[conv], current="xss")
    page.wait_models()
    messages = page.by_id("messages")
    assert XSS in messages.text
    made = "#messages img, #messages svg, #messages b, #messages i, #conversations script"
    assert page.js("return document.querySelectorAll(arguments[0]).length", made) == 0
    assert page.js("return document.querySelector('#messages pre code').textContent") == "print('<b>hi</b>')"
    assert page.js("return document.querySelector('#messages pre').dataset.lang") == "python"
    assert page.js("return document.querySelector('#messages :not(pre) > code').textContent") == "<i>x</i>"
    assert (
        page.js("return document.querySelector('.tool-call .name').textContent")
        == "<img src=y onerror=alert(3)>"
    )
    assert '"<svg onload=alert(4)>"' in page.js("return document.querySelector('.tool-call pre').textContent")
    assert page.titles() == ["<script>alert(2)</script>"]
    assert page.no_alert()
    assert page.errors() == []


@needs_browser
def test_api_error_is_shown_and_the_question_comes_back(page):
    page.open(settings={"max_tokens": "100000"})  # more than the 4096-token context
    page.wait_models()
    page.ask(PARIS_Q)
    page.wait(lambda: page.by_id("error").is_displayed(), 10, "no error shown")
    page.wait_idle(5)
    assert "maximum context length" in page.by_id("error-text").text
    assert page.texts("assistant") == []
    assert page.by_id("input").get_attribute("value") == PARIS_Q
    assert page.errors(allow="400") == []


R1_TEMPLATE = (
    ROOT / "bench/.build/src/vendor/llama.cpp/models/templates/deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
)


@needs_browser
def test_thinking_streams_collapsed_above_the_answer(browser, tmp_path):
    """SmolLM2 under DeepSeek-R1's template thinks (its budget closes the block), and the page shows the reasoning
    in a collapsed block above the answer, marked as still thinking while it streams."""
    if not R1_TEMPLATE.is_file():
        pytest.skip(f"{R1_TEMPLATE} not present (make test extracts llama.cpp's templates)")
    srv = start_server(
        tmp_path, "smollm2", "--api-key", KEY, "--chat-template", str(R1_TEMPLATE), "--reasoning-budget", "24"
    )
    try:
        page = Page(browser, srv.base_url)
        page.open(settings={"temperature": "0", "max_tokens": "48"})
        page.wait_models()
        page.js(
            "window.summaries = [];"
            "new MutationObserver(() => {"
            "  const s = document.querySelector('#messages .msg.assistant.pending .thinking summary');"
            "  if (s) window.summaries.push(s.textContent);"
            "}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});"
        )
        page.ask(PARIS_Q)
        page.wait_idle()
        thinking = page.js(
            "const d = document.querySelector('#messages .msg.assistant .body > details.thinking');"
            "return d && {open: d.open, first: d.parentElement.firstElementChild === d,"
            " summary: d.querySelector('summary').textContent, text: d.textContent}"
        )
        assert thinking and not thinking["open"] and thinking["first"], thinking
        assert thinking["summary"] == "Thought" and len(thinking["text"]) > len("Thought")
        assert "Thinking…" in page.js("return window.summaries")
        stored = json.loads(page.js("return localStorage.getItem('quantserve.conversations')"))
        reply = stored[0]["messages"][-1]
        assert reply["reasoning"] and "</think>" not in reply["content"]
        assert page.errors() == []
    finally:
        srv.stop()


@needs_browser
def test_stored_reasoning_with_markup_stays_text(page):
    conv = {
        "id": "think",
        "title": "t",
        "system": "",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning": XSS},
        ],
    }
    page.open(conversations=[conv], current="think")
    page.wait_models()
    assert page.js("return document.querySelector('.thinking').textContent").endswith(XSS)
    assert page.js("return document.querySelectorAll('#messages img').length") == 0
    assert page.no_alert()
