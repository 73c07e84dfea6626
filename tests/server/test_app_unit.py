"""The app in-process: readiness while loading, chat template override, a model without a template."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from fastapi.testclient import TestClient

from quantserve.llm import LLM, EngineSettings
from quantserve.registry import ModelEntry, ResolvedModel
from quantserve.server.app import create_app
from quantserve.server.settings import ServerSettings
from tests.conftest import PARIS, THREADS


@pytest.fixture()
def resolved(smollm2_gguf) -> ResolvedModel:
    return ResolvedModel("smollm2", smollm2_gguf, ModelEntry(source=str(smollm2_gguf)))


def test_ready_and_api_answer_503_until_the_model_is_loaded(monkeypatch):
    gate = threading.Event()
    real_load = LLM.load

    def slow_load(*args, **kwargs):
        gate.wait(30)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(LLM, "load", staticmethod(slow_load))
    app = create_app(ServerSettings(model="smollm2", threads=THREADS))
    with TestClient(app) as client:
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        r = client.post("/v1/chat/completions", json={"messages": PARIS, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert client.get("/health").status_code == 200  # alive while loading
        gate.set()
        for _ in range(300):
            if client.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert client.get("/ready").json()["status"] == "ready"
        assert (
            client.post("/v1/chat/completions", json={"messages": PARIS, "max_tokens": 2}).status_code == 200
        )


def test_chat_template_override_is_used(resolved, tmp_path):
    tmpl = tmp_path / "qa.jinja"
    tmpl.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    llm = LLM.load(resolved, EngineSettings(threads=THREADS, chat_template=str(tmpl)))
    with TestClient(create_app(ServerSettings(), llm=llm)) as client:
        r = client.post("/v1/chat/completions", json={"messages": PARIS[1:], "max_tokens": 2})
        expected = llm.tokenize_prompt("Q: What is the capital of France?\nA:", chat=True)
        assert r.json()["usage"]["prompt_tokens"] == len(expected)


def test_model_without_chat_template_gets_a_clear_400_for_chat_only(resolved):
    llm = LLM.load(resolved, EngineSettings(threads=THREADS))
    llm.chat_template = None
    with TestClient(create_app(ServerSettings(), llm=llm)) as client:
        r = client.post("/v1/chat/completions", json={"messages": PARIS, "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "chat_template_error"
        assert "--chat-template" in err["message"]
        r = client.post("/v1/completions", json={"prompt": "Paris is", "max_tokens": 2})
        assert r.status_code == 200


def test_bad_grammar_schema_is_400_not_an_engine_failure(resolved):
    llm = LLM.load(resolved, EngineSettings(threads=THREADS))
    with TestClient(create_app(ServerSettings(), llm=llm)) as client:
        body = {
            "messages": PARIS,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}},
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        assert (
            client.post("/v1/chat/completions", json={"messages": PARIS, "max_tokens": 2}).status_code == 200
        )


def test_the_openapi_schema_declares_every_path_parameter():
    """What schemathesis reads: a {name} in a route's path is a declared parameter of each of its operations
    (the /api/blobs/{digest} stub once left it out, and no client could be generated for it)."""
    import re

    spec = create_app(ServerSettings()).openapi()
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert set(re.findall(r"{(\w+)}", path)) <= declared, (method, path)


def _count(monkeypatch, counts: Counter, name: str, *owners) -> None:
    """Count the calls of function `name` wherever `owners` (modules, classes) hold it."""
    real = getattr(owners[0], name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)

    for owner in owners:
        monkeypatch.setattr(owner, name, counted)


def test_a_single_model_run_plans_once_and_probes_the_template_once(monkeypatch):
    """`quantserve run MODEL` plans before it listens (prepare), and the first load carries out that plan: the
    template the plan probed (with the BOS and EOS the GGUF names) is the one the loaded model renders with."""
    from quantserve.backends import select
    from quantserve.chat.template import ChatTemplate, TemplateProbe
    from quantserve.server import catalog

    ChatTemplate.shared.cache_clear()  # another test in this process may have probed the same template
    counts: Counter = Counter()
    _count(monkeypatch, counts, "plan_model", select)
    _count(monkeypatch, counts, "of", TemplateProbe)
    settings = ServerSettings(model="smollm2", threads=THREADS)
    app = create_app(settings, prepared=catalog.prepare(settings))
    with TestClient(app) as client:
        for _ in range(600):
            if client.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert (
            client.post("/v1/chat/completions", json={"messages": PARIS, "max_tokens": 2}).status_code == 200
        )
    assert counts == {"plan_model": 1, "of": 1}


def test_router_mode_reads_models_toml_once(monkeypatch, smollm2_gguf, tmp_path):
    from quantserve import registry
    from quantserve.server import catalog
    from quantserve.server import settings as server_settings

    toml = tmp_path / "models.toml"
    toml.write_text(f'[models.a]\nsource = "{smollm2_gguf}"\n[models.b]\nsource = "{smollm2_gguf}"\n')
    counts: Counter = Counter()
    _count(monkeypatch, counts, "load_registry", registry, catalog, server_settings)
    settings = ServerSettings(models_file=str(toml), threads=THREADS)
    app = create_app(settings, prepared=catalog.prepare(settings))
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b"]
    assert counts == {"load_registry": 1}
