"""Every `quantserve run` setting also reads QUANTSERVE_<NAME>: the command line wins over the environment, which
wins over models.toml, which wins over the default; --api-key-file keeps the key off every command line. The CLI
runs in-process with the server itself replaced by a function that keeps the settings it was given."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from quantserve.cli import main
from quantserve.server.settings import ServerSettings


@pytest.fixture()
def run(monkeypatch):
    seen: list[ServerSettings] = []
    monkeypatch.setattr("quantserve.server.serve.serve", lambda settings: seen.append(settings) or 0)

    def invoke(*args: str, env: dict | None = None) -> ServerSettings:
        r = CliRunner().invoke(main, ["run", *args], env=env)
        assert r.exit_code == 0, r.output
        return seen.pop()

    return invoke


def test_each_setting_has_its_variable_and_help_shows_it():
    r = CliRunner().invoke(main, ["run", "--help"], terminal_width=200)
    for name in ServerSettings.model_fields:
        if name != "model":
            assert f"QUANTSERVE_{name.upper()}" in r.output, name


def test_the_command_line_wins_over_the_environment(run):
    env = {"QUANTSERVE_CTX_SIZE": "1234", "QUANTSERVE_API_KEY": "from-env", "QUANTSERVE_NO_CACHE": "1"}
    s = run("smollm2", env=env)
    assert (s.ctx_size, s.api_key, s.no_cache) == (1234, "from-env", True)
    s = run("smollm2", "--ctx-size", "99", "--api-key", "from-flag", env=env)
    assert (s.ctx_size, s.api_key) == (99, "from-flag")
    assert run("smollm2").ctx_size == ServerSettings.model_fields["ctx_size"].default  # neither


def test_the_environment_wins_over_models_toml(run, tmp_path, smollm2_gguf):
    toml = tmp_path / "models.toml"
    toml.write_text(f'[models.m]\nsource = "{smollm2_gguf}"\nctx_size = 2048\n')
    for env, want in (({}, 2048), ({"QUANTSERVE_CTX_SIZE": "1024"}, 1024)):
        s = run("m", "--models-file", str(toml), env=env)
        resolved, engine = s.resolve_model()
        assert engine.for_model(resolved.entry).ctx_size == want


def test_the_key_from_a_file(run, tmp_path):
    (tmp_path / "key").write_text("file-s3cret\n")
    s = run("smollm2", "--api-key-file", str(tmp_path / "key"))
    assert s.api_key == "file-s3cret" and s.api_key_file is None  # read once; a child gets the key
    s = run("smollm2", env={"QUANTSERVE_API_KEY_FILE": str(tmp_path / "key")})
    assert s.api_key == "file-s3cret"
    bad = CliRunner().invoke(main, ["run", "smollm2", "--api-key-file", str(tmp_path / "none")])
    assert bad.exit_code == 2 and f"cannot read a key from {tmp_path / 'none'}" in bad.output
    both = CliRunner().invoke(
        main, ["run", "smollm2", "--api-key", "k", "--api-key-file", str(tmp_path / "key")]
    )
    assert both.exit_code == 2 and "not both" in both.output


def test_a_bad_origin_is_refused_by_name():
    r = CliRunner().invoke(main, ["run", "smollm2"], env={"QUANTSERVE_ALLOWED_ORIGINS": "localhost:3000"})
    assert r.exit_code == 2 and "--allowed-origins: 'localhost:3000' is not an origin" in r.output


def test_threads_left_at_zero_follow_quantserve_threads_outside_run_too(monkeypatch):
    """The library, `eval` and `convert --check` leave threads at 0 (all cores): QUANTSERVE_THREADS, where set,
    is what the backends then use, as `run` reads it."""
    from quantserve.core.settings import cpu_threads

    monkeypatch.setenv("QUANTSERVE_THREADS", "3")
    assert (cpu_threads(0), cpu_threads(2)) == (3, 2)
    monkeypatch.delenv("QUANTSERVE_THREADS")
    assert cpu_threads(0) == 0  # the backend's own default: every core
