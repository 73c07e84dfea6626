"""models.toml: names, aliases, package and path sources, hub ids offline, and the errors."""

from __future__ import annotations

import pytest

from quantserve.errors import ConfigError, ModelNotFoundError
from quantserve.registry import find_models_toml, load_registry, resolve


def _write(tmp_path, text: str):
    p = tmp_path / "models.toml"
    p.write_text(text)
    return load_registry(p)


def test_project_models_toml_resolves_smollm2_offline(smollm2_gguf):
    reg = load_registry(find_models_toml(None))
    assert reg.default == "smollm2"
    for name in ("smollm2", "SmolLM2-135M-Instruct", "smollm2-135m", None):
        r = resolve(name, reg)
        assert r.name == "smollm2" and r.path == smollm2_gguf
    assert reg.entries["smollm2"].sampling["temperature"] == 0.2


def test_paths_are_relative_to_the_toml_and_paths_resolve_directly(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    reg = _write(tmp_path, '[models.local]\nsource = "m.gguf"\n')
    assert resolve("local", reg).path == tmp_path / "m.gguf"
    assert resolve(str(tmp_path / "m.gguf"), reg).path == tmp_path / "m.gguf"


def test_unknown_name_lists_the_known_ones(tmp_path):
    reg = _write(tmp_path, '[models.a]\nsource = "x"\n[models.b]\nsource = "y"\n')
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'zzz'.*known: a, b"):
        resolve("zzz", reg)


def test_typo_in_entry_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"\[models.a\].*sorce"):
        _write(tmp_path, '[models.a]\nsorce = "x"\n')
    with pytest.raises(ConfigError, match="default"):
        _write(tmp_path, 'default = "nope"\n[models.a]\nsource = "x"\n')


def test_missing_package_says_how_to_install(tmp_path):
    reg = _write(tmp_path, '[models.p]\nsource = "package:no_such_pkg_xyz/model.gguf"\n')
    with pytest.raises(ModelNotFoundError, match="not installed"):
        resolve("p", reg)


def test_hub_id_offline_uses_the_cache_only(tmp_path, monkeypatch):
    # A hand-made Hugging Face cache entry, laid out as huggingface_hub writes it.
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    import huggingface_hub._snapshot_download as sd

    monkeypatch.setattr(sd, "HF_HUB_CACHE", str(cache), raising=False)
    monkeypatch.setattr(sd.constants, "HF_HUB_CACHE", str(cache), raising=False)
    reg = _write(tmp_path, "")
    assert resolve("org/tiny", reg).path == snap
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve("org/absent", reg)
