"""ModelPlan: what quantserve decides about a model before loading it is decided once, and every reader agrees with
it: the load itself (what `inspect` prints is what the load logs and does), /v1/models, Ollama's listing and the
loaded model's own behaviour."""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest
from click.testing import CliRunner

from quantserve.cli import main
from quantserve.core.settings import EngineSettings
from quantserve.formats import detect
from quantserve.formats.hf_config import find_chat_template
from quantserve.llm import LLM
from quantserve.registry import load_registry, resolve
from quantserve.rerank import rerank_kind
from quantserve.server.catalog import model_card, served_card
from quantserve.server.served import Served

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_hf, smollm2_hf, tmp_path_factory):
    """The tiny random Llama with its chat template only in chat_template.json (as newer transformers save it)."""
    d = tmp_path_factory.mktemp("plan") / "tiny"
    shutil.copytree(tiny_llama_hf, d)
    template, _ = find_chat_template(smollm2_hf)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert not (d / "chat_template.jinja").exists()
    return d


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QUANTSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "plan-cache"))


def _resolved(path):
    return resolve(str(path), load_registry(None))


def _inspect(*args: str) -> dict[str, list[str]]:
    """`quantserve inspect`'s rows, key -> lines."""
    r = CliRunner().invoke(main, ["inspect", *map(str, args)])
    assert r.exit_code == 0, r.output
    rows: dict[str, list[str]] = {}
    key = ""
    for line in r.output.splitlines():
        if line[:1] != " ":
            key, _, value = line.partition(":")
            rows[key] = [value.strip()]
        else:
            rows[key].append(line.strip())
    return rows


def test_a_template_only_in_chat_template_json_gives_chats_everywhere(tiny_hf):
    plan = LLM.plan_for(_resolved(tiny_hf), EngineSettings(backend="torch"))
    assert plan.template is not None and plan.template.origin.endswith("chat_template.json")
    assert {"chat", "tools"} <= set(plan.capabilities) and plan.tool_format == "generic"
    rows = _inspect(tiny_hf, "--backend", "torch")
    assert rows["chat template"] == [plan.template.origin]
    assert rows["capabilities"] == [", ".join(plan.capabilities)]
    served = Served("tiny", None, EngineSettings())  # a router's served before the model loads
    served.set_plan(plan)
    assert served_card(served)["capabilities"] == list(plan.capabilities)
    llm = LLM.load(_resolved(tiny_hf), EngineSettings(backend="torch", ctx_size=256))
    try:
        assert model_card(llm)["capabilities"] == list(plan.capabilities)
        assert llm.chat_template is not None and llm.render_chat([{"role": "user", "content": "hi"}])
    finally:
        llm.close()


@pytest.mark.parametrize("which", ["gguf", "torch"])
def test_each_capability_is_what_the_loaded_model_does(which, smollm2_gguf, tiny_hf):
    path, settings = (smollm2_gguf, EngineSettings(ctx_size=256)) if which == "gguf" else (tiny_hf, None)
    settings = settings or EngineSettings(backend="torch", ctx_size=256)
    llm = LLM.load(_resolved(path), settings)
    try:
        caps = set(llm.plan.capabilities)
        assert model_card(llm)["capabilities"] == list(llm.plan.capabilities)
        assert ("chat" in caps) == (llm.chat_template is not None)
        assert ("tools" in caps) == (llm.tool_format is not None)
        assert ("vision" in caps) == llm.takes_images
        assert ("rerank" in caps) == (rerank_kind(llm) is not None)
        assert llm.n_ctx == llm.plan.n_ctx == 256
        if "embeddings" in caps:
            import asyncio

            assert len(asyncio.run(llm.embed(llm.tokenize_text("hello world")))) > 0
        assert llm.info.backend == llm.plan.backend == ("llamacpp" if which == "gguf" else "torch")
    finally:
        llm.close()


@pytest.fixture(scope="module")
def gptq_dir(tiny_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan-gptq") / "gptq"
    r = CliRunner().invoke(
        main, ["convert", "--src", str(tiny_hf), "--dst", str(out), "--quant", "rtn", "--group-size", "32"]
    )
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def llava_dir(smollm2_hf, tmp_path_factory):
    from tests.fixtures.vision import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("plan-llava") / "llava", smollm2_hf)


@pytest.mark.parametrize("which", ["gguf", "hf", "gptq", "llava"])
def test_inspect_prints_what_run_does(which, smollm2_gguf, tiny_hf, gptq_dir, llava_dir, caplog):
    """`inspect MODEL` prints the plan; the load that `quantserve run MODEL` makes logs the plan it carries out,
    and it is the same, line for line. Without CUDA, all four go to llama.cpp: the HF ones after conversion."""
    path = {"gguf": smollm2_gguf, "hf": tiny_hf, "gptq": gptq_dir, "llava": llava_dir}[which]
    rows = _inspect(path)
    plan_keys = list(rows)[list(rows).index("backend") :]
    printed = [(k, line) for k in plan_keys for line in rows[k]]
    with caplog.at_level(logging.INFO, logger="quantserve"):
        llm = LLM.load(_resolved(path), EngineSettings())
    try:
        prefix = f"plan for {path.name}: "
        logged = [
            tuple(r.getMessage().removeprefix(prefix).split(": ", 1))
            for r in caplog.records
            if r.getMessage().startswith(prefix)
        ]
        assert logged == printed
        assert llm.plan.backend == "llamacpp" and rows["backend"][0].startswith("llamacpp — ")
        assert llm.n_ctx == llm.plan.n_ctx and rows["context"] == [f"{llm.n_ctx} tokens"]
        assert llm._runner.kv_spec.cells == llm.plan.kv.cells  # the cache the plan sized is the one allocated
        assert ("vision" in llm.plan.capabilities) == llm.takes_images == (which == "llava")
        steps = rows["steps"]
        if which == "gptq":
            assert steps[0].startswith("dequantize the GPTQ 4-bit") and "convert to GGUF q8_0" in steps[1]
        if which in ("hf", "llava"):
            assert steps[0].startswith("convert to GGUF f32")
        assert any(s.startswith("probe: ") for s in steps)
    finally:
        llm.close()


def test_detect_runs_once_per_load(smollm2_gguf, tiny_hf):
    """Counted on detect()'s code object, however a module imported it."""
    code = detect.__code__
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(str(frame.f_locals.get("path")))

    for path, settings in (
        (smollm2_gguf, EngineSettings(ctx_size=128)),
        (tiny_hf, EngineSettings(backend="torch")),
    ):
        calls.clear()
        sys.setprofile(profile)
        try:
            llm = LLM.load(_resolved(path), settings)
        finally:
            sys.setprofile(None)
        llm.close()
        assert len(calls) == 1, calls


def test_inspect_with_a_chat_template_shows_what_that_template_gives(smollm2_gguf, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rows = _inspect(smollm2_gguf, "--chat-template", template)
    assert rows["chat template"] == [f"--chat-template {template}"] and rows["tool calls"] == ["generic"]
    (tmp_path / "bad.jinja").write_text("{% for %}")
    r = CliRunner().invoke(
        main, ["inspect", str(smollm2_gguf), "--chat-template", str(tmp_path / "bad.jinja")]
    )
    assert r.exit_code == 2 and "does not parse" in r.output


def test_an_i_quant_that_needs_an_imatrix_is_refused_at_plan_and_says_how_to_make_it(tiny_hf):
    """`run HF_DIR --quant iq2_xxs` (and `inspect`) stop at the plan, before any conversion: a load computes no
    importance matrix. A type that needs none plans a conversion to itself."""
    from quantserve.errors import ConfigError

    settings = EngineSettings(backend="llamacpp", quant="iq2_xxs")
    with pytest.raises(
        ConfigError, match=r"needs an importance matrix.*quantserve convert .*--calib builtin"
    ):
        LLM.plan_for(_resolved(tiny_hf), settings)
    plan = LLM.plan_for(_resolved(tiny_hf), EngineSettings(backend="llamacpp", quant="iq4_xs"))
    assert any("convert to GGUF iq4_xs" in step for step in plan.steps)
