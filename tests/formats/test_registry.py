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


def test_every_run_flag_lands_in_one_engine_setting(tmp_path):
    """ServerSettings -> EngineSettings is by name: a flag that neither the server nor a settings section reads
    fails here, instead of being dropped."""
    from quantserve.core.settings import EngineSettings
    from quantserve.server.settings import SERVER_ONLY, ServerSettings

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    toml = tmp_path / "models.toml"
    toml.write_text('[models.m]\nsource = "m.gguf"\n')
    flags = dict(ctx_size=300, kv_size=900, kv_unified=True, flash_attn="off", cache_type_k="q8_0", threads=3,
                 n_gpu_layers=-1, no_cache=True, max_num_seqs=5, n_batch=64)  # fmt: skip
    _, engine = ServerSettings(model="m", models_file=str(toml), **flags).resolve_model()
    assert (engine.ctx_size, engine.kv_size, engine.threads, engine.max_num_seqs, engine.n_batch) == (
        300,
        900,
        3,
        5,
        64,
    )
    assert (
        engine.llamacpp.kv_unified
        and engine.llamacpp.flash_attn == "off"
        and engine.llamacpp.n_gpu_layers == -1
    )
    assert engine.llamacpp.cache_type_k == "q8_0" and engine.use_cache is False
    assert set(ServerSettings.model_fields) - SERVER_ONLY <= set(EngineSettings.__dataclass_fields__) | {
        f for section in (engine.llamacpp, engine.torch) for f in section.__dataclass_fields__
    }
    with pytest.raises(TypeError, match="unknown engine setting 'ctx'"):
        EngineSettings.from_options(ctx=1)


def test_models_toml_defaults_fill_only_what_was_not_given(tmp_path):
    from quantserve.core.settings import EngineSettings

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    reg = _write(tmp_path, '[models.m]\nsource = "m.gguf"\nbackend = "torch"\nquant = "int4"\nctx_size = 256\n'
                           '[models.m.sampling]\ntemperature = 0.3\ntop_k = 5\n')  # fmt: skip
    entry = resolve("m", reg).entry
    s = EngineSettings(ctx_size=512, sampling_defaults={"top_k": 9}).for_model(entry)
    assert (s.backend, s.quant, s.ctx_size) == ("torch", "int4", 512)
    assert s.sampling_defaults == {"temperature": 0.3, "top_k": 9}
    assert EngineSettings(backend="llamacpp", quant="q8_0").for_model(entry).backend == "llamacpp"
