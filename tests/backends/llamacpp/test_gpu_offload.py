"""--n-gpu-layers auto: the layer fitting (a pure function), the decision on the real SmolLM2 GGUF against faked
devices, the setting's forms (flag, models.toml, library), and what this CPU build does (0, quietly)."""

from __future__ import annotations

import logging

import pytest

from quantserve.backends.llamacpp.offload import ALL, MARGIN, Device, fit_layers, gpu_device, plan_offload
from quantserve.core.model_size import gguf_shape, llamacpp_kv
from quantserve.core.settings import EngineSettings
from quantserve.formats import read_gguf_info

GIB = 2**30


def test_a_model_that_fits_gets_every_layer_and_the_output():
    assert fit_layers([GIB] * 32, GIB, GIB // 8, GIB, free=48 * GIB) == ALL


def test_a_model_twice_the_free_memory_gets_about_half():
    layers, kv, output, buffers = [GIB // 2] * 40, GIB // 16, GIB, GIB // 2
    need = sum(layers) + kv * 40 + output
    n = fit_layers(layers, output, kv, buffers, free=need // 2 + MARGIN + buffers)
    assert 18 <= n <= 20


def test_nothing_fits_when_the_margin_eats_the_memory():
    assert fit_layers([GIB] * 4, GIB, 0, 0, free=MARGIN + GIB // 2) == 0


def _smollm2(smollm2_gguf):
    info = read_gguf_info(smollm2_gguf)
    return info, gguf_shape(info.metadata)


def test_plan_on_smollm2(smollm2_gguf):
    info, shape = _smollm2(smollm2_gguf)
    auto = EngineSettings()
    big = Device("CUDA0", "NVIDIA GeForce RTX 4090", free=22 * GIB, total=24 * GIB)
    plan = plan_offload(smollm2_gguf, auto, big)
    assert plan.n_gpu_layers == ALL and plan.n_layer == shape.n_layer == 30
    assert plan.describe().startswith("all 30 layers and the output on NVIDIA GeForce RTX 4090 (")
    # a device with room for the margin, the buffers and half the layers: about half, counted from the end
    need = sum(t.n_bytes for t in info.tensors if t.name.startswith("blk.")) + llamacpp_kv(shape, auto).bytes
    buffers = 512 * (49152 + 16 * 576) * 4  # n_batch x (vocab + 16 x n_embd) fp32
    small = Device("Metal", "Apple M2", free=need // 2 + MARGIN + buffers, total=0)
    half = plan_offload(smollm2_gguf, auto, small)
    assert 13 <= half.n_gpu_layers <= 15, half
    assert half.describe().startswith(f"{half.n_gpu_layers} of 30 layers on Apple M2, the rest on the CPU")


def test_explicit_numbers_win_and_a_cpu_build_gets_zero(smollm2_gguf):
    dev = Device("CUDA0", "RTX", free=1 * GIB, total=8 * GIB)
    seven = EngineSettings.from_options(n_gpu_layers=7)
    assert plan_offload(smollm2_gguf, seven, dev).n_gpu_layers == 7
    assert (
        plan_offload(smollm2_gguf, EngineSettings.from_options(n_gpu_layers="all"), dev).n_gpu_layers == ALL
    )
    cpu = plan_offload(smollm2_gguf, EngineSettings(), None)
    assert (
        cpu.n_gpu_layers == 0
        and cpu.describe() == "all layers on the CPU (this llama.cpp build has no GPU backend)"
    )
    assert (
        "--n-gpu-layers 7 given, but this llama.cpp build has no GPU backend"
        in plan_offload(smollm2_gguf, seven, None).describe()
    )


def test_this_build_has_no_gpu():
    assert gpu_device() is None


@pytest.mark.parametrize(
    "value,want",
    [("auto", None), (None, None), ("all", -1), ("ALL", -1), (-1, -1), ("0", 0), (12, 12), ("12", 12)],
)
def test_setting_forms(value, want):
    assert EngineSettings.from_options(n_gpu_layers=value).llamacpp.n_gpu_layers == want


@pytest.mark.parametrize("value", ["most", "-2", 2.5, "1e3"])
def test_bad_values_say_what_is_accepted(value):
    with pytest.raises(ValueError, match="give auto, all \\(or -1\\), or a number of layers"):
        EngineSettings.from_options(n_gpu_layers=value)


def test_server_flag_and_models_toml(tmp_path):
    from pydantic import ValidationError

    from quantserve.registry import ModelEntry
    from quantserve.server.settings import ServerSettings

    assert ServerSettings(model="x").engine_settings().llamacpp.n_gpu_layers is None  # auto by default
    assert ServerSettings(model="x", n_gpu_layers="20").engine_settings().llamacpp.n_gpu_layers == 20
    with pytest.raises(ValidationError, match="n_gpu_layers 'lots'"):
        ServerSettings(model="x", n_gpu_layers="lots")
    entry = ModelEntry(source="a.gguf", n_gpu_layers="all")
    assert EngineSettings().for_model(entry).llamacpp.n_gpu_layers == -1  # the entry fills in auto
    flagged = EngineSettings.from_options(n_gpu_layers=3).for_model(entry)
    assert flagged.llamacpp.n_gpu_layers == 3  # a number given on the command line wins
    with pytest.raises(ValidationError):
        ModelEntry(source="a.gguf", n_gpu_layers="half")


def test_a_cpu_run_logs_no_offload_line_above_debug(smollm2_gguf, caplog):
    from quantserve.backends.llamacpp.model import LlamaCppRunner

    with caplog.at_level(logging.INFO, logger="quantserve.llamacpp"):
        runner = LlamaCppRunner(smollm2_gguf, EngineSettings(ctx_size=256, max_num_seqs=1))
    try:
        assert runner.offload.n_gpu_layers == 0
        assert not [r for r in caplog.records if "GPU offload" in r.getMessage()]
    finally:
        runner.close()
