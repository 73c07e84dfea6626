"""The quantserve command line: run's startup errors, models, inspect, --help."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, THREADS


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quantserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_run_unknown_model_lists_known_names():
    r = _cli("run", "no-such-model", "--port", "1")
    assert r.returncode == 2
    assert "unknown model 'no-such-model'" in r.stderr and "smollm2" in r.stderr


def test_run_truncated_gguf_exits_2_with_a_clear_error(smollm2_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    with smollm2_gguf.open("rb") as f:
        bad.write_bytes(f.read(5_000_000))
    r = _cli("run", str(bad), "--port", "1")
    assert r.returncode == 2, r.stderr
    assert "truncated" in r.stderr


def test_models_command_lists_entries():
    r = _cli("models")
    assert r.returncode == 0
    assert "smollm2" in r.stdout and "(default)" in r.stdout


def test_run_help_documents_options():
    r = _cli("run", "--help")
    assert r.returncode == 0
    for opt in (
        "--ctx-size",
        "--threads",
        "--n-gpu-layers",
        "--api-key",
        "--max-num-seqs",
        "--cache-type-k",
        "--seed",
        "--chat-template",
    ):
        assert opt in r.stdout


def test_python_m_quantserve_is_the_cli():
    r = subprocess.run(
        [sys.executable, "-m", "quantserve", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0 and r.stdout.startswith("quantserve, version"), r.stderr


def test_shell_completion_scripts_complete_commands_and_options():
    """`quantserve completion SHELL` prints click's script for that shell; the script calls back with
    _QUANTSERVE_COMPLETE set, and the answer lists the matching commands and options."""
    from click.testing import CliRunner

    from quantserve.cli import main

    for shell, mark in (
        ("bash", "complete -o nosort -F"),
        ("zsh", "compdef"),
        ("fish", "complete --no-files"),
    ):
        r = CliRunner().invoke(main, ["completion", shell])
        assert r.exit_code == 0 and "_QUANTSERVE_COMPLETE" in r.output and mark in r.output, (shell, r.output)

    def complete(words: str) -> list[str]:
        env = {"_QUANTSERVE_COMPLETE": "bash_complete", "COMP_WORDS": words}
        env["COMP_CWORD"] = str(len(words.split()) - 1)
        r = CliRunner().invoke(main, [], env=env, prog_name="quantserve")
        return [line.split(",", 1)[1] for line in r.output.splitlines()]

    assert sorted(complete("quantserve co")) == ["completion", "convert"]
    assert "--ctx-size" in complete("quantserve run --ctx")
    assert CliRunner().invoke(main, ["completion", "tcsh"]).exit_code == 2


def test_inspect_by_name_and_by_path(smollm2_gguf):
    for arg in ("smollm2", str(smollm2_gguf)):
        r = _cli("inspect", arg)
        assert r.returncode == 0, r.stderr
        rows = {
            k: v.strip() for k, _, v in (ln.partition(":") for ln in r.stdout.splitlines() if ln[:1] != " ")
        }
        assert rows["format"] == "gguf" and rows["architecture"] == "llama"
        assert "134,515,008" in rows["parameters"] and rows["trained context"] == "8192"
        assert rows["backend"].startswith("llamacpp — ") and rows["context"].endswith(" tokens")
        assert "Q4_1" in r.stdout


def test_inspect_refuses_a_pickle_with_exit_2(tmp_path):
    bad = tmp_path / "pytorch_model.bin"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    r = _cli("inspect", str(bad))
    assert r.returncode == 2
    assert "pickle" in r.stderr.lower() and "safetensors" in r.stderr


def test_boolean_settings_are_flags():
    r = _cli("run", "--help")
    assert "--kv-unified / --no-kv-unified" in r.stdout
    assert "--no-cache " in r.stdout and "--no-no-cache" not in r.stdout


def test_convert_check_prints_the_quality_table(smollm2_hf, tmp_path):
    out = tmp_path / "smol.q8_0.gguf"
    env_cache = {"QUANTSERVE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "quantserve.cli",
            "convert",
            "--src",
            str(smollm2_hf),
            "--dst",
            str(out),
            "--quant",
            "q8_0",
            "--check",
            "--threads",
            str(THREADS),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**__import__("os").environ, **env_cache},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| source") or ln.startswith("| output")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    ppl_delta, kl, top1 = float(cells[5].rstrip(" %")), float(cells[6]), float(cells[7].rstrip(" %"))
    assert kl < 0.02 and top1 > 95 and abs(ppl_delta) < 3  # q8_0 of a model is nearly lossless


def test_eval_ppl_with_too_short_a_text_exits_2_and_says_why(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    r = _cli("eval", "ppl", "smollm2", "--text", str(short))
    assert r.returncode == 2
    assert "needs at least 1024" in r.stderr
