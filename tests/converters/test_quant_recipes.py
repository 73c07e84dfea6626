"""Calibration sources and mixed-precision recipes: the sensitivity pass against transformers, the bits budget,
GPTQ `dynamic` overrides read back, AWQ+GPTQ, --calib self, and the CLI's errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from quantserve.cli import main as cli
from quantserve.converters.calibration.driver import QuantizedLinear, quantize_model
from quantserve.converters.calibration.layers import LINEARS
from quantserve.converters.calibration.quantize import quantize_checkpoint
from quantserve.converters.calibration.recipes import (
    HIGH_BITS,
    Sensitivity,
    linear_bpw,
    plan_budget,
    sensitivity,
)
from quantserve.errors import ConfigError
from quantserve.quant.rtn import quantize_rtn
from tests.converters.test_quantizers import _gen, _hidden, _tiny_llama


def test_sensitivity_matches_transformers(tmp_path: Path) -> None:
    """Each linear's KL, against the same thing computed plainly with transformers' LlamaForCausalLM."""
    from transformers import LlamaForCausalLM

    d = _tiny_llama(tmp_path / "m", seed=3)
    tokens = torch.randint(0, 256, (2, 24), generator=_gen(4))
    got = sensitivity(d, tokens, 3, 32, max_positions=1000, progress=False)
    assert got.n_positions == tokens.numel()

    model = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(tokens).logits.reshape(-1, 256), -1)
        want = {}
        for i in range(2):
            for name in LINEARS:
                linear = model.model.layers[i].get_submodule(name)
                w = linear.weight.detach().clone()
                linear.weight.copy_(quantize_rtn(w, 3, 32, True, torch.float16).dequantize().t())
                lq = torch.log_softmax(model(tokens).logits.reshape(-1, 256), -1)
                linear.weight.copy_(w)
                want[f"model.layers.{i}.{name}"] = float((ref.exp() * (ref - lq)).sum(-1).mean())
    assert set(got.kl) == set(want)
    for p, kl in want.items():
        assert got.kl[p] == pytest.approx(kl, rel=0.02, abs=1e-6), p
    assert max(got.kl, key=got.kl.get) == max(want, key=want.get)


def _sens(kl: dict[str, float], shape: tuple[int, int] = (64, 64)) -> Sensitivity:
    return Sensitivity(kl, dict.fromkeys(kl, shape), 1, 0.0)


def test_plan_budget_raises_the_most_kl_per_bit_within_the_budget() -> None:
    kl = {
        f"model.layers.0.{n}": v for n, v in zip(LINEARS, (0.5, 0.1, 0.05, 0.3, 0.02, 0.01, 0.2), strict=True)
    }
    base = linear_bpw(64, 64, 4, 32)
    high = linear_bpw(64, 64, HIGH_BITS, 32)
    for budget in (base, base + 0.5, 5.9, 6.8, 100):
        plan = plan_budget(_sens(kl), 4, 32, budget)
        assert plan.base_bpw == pytest.approx(base)
        assert plan.bpw <= budget + 1e-9
        raised = sorted(plan.overrides, key=kl.get, reverse=True)
        # equal shapes: the raised ones are exactly the highest KLs, and one more would not fit
        assert raised == sorted(kl, key=kl.get, reverse=True)[: len(raised)]
        assert len(raised) == min(len(kl), int((budget - base) * len(kl) / (high - base) + 1e-9))
        assert all(v == (HIGH_BITS, 32) for v in plan.overrides.values())
    with pytest.raises(ConfigError, match="below"):
        plan_budget(_sens(kl), 4, 32, base - 0.01)


def test_bits_budget_writes_dynamic_overrides_that_read_back(tmp_path: Path) -> None:
    from quantserve.formats import detect
    from quantserve.formats.quant_read import open_quantized

    d = _tiny_llama(tmp_path / "m", seed=5)
    tokens = torch.randint(0, 256, (4, 32), generator=_gen(6))
    r = quantize_checkpoint(d, tmp_path / "q", "gptq", group_size=32, calib_tokens=tokens, bits_budget=6.0,
                            progress=False)  # fmt: skip
    assert r.overrides and r.linear_bpw <= 6.0
    qc = json.loads((r.path / "config.json").read_text())["quantization_config"]
    rules = {k for k in qc["dynamic"] if k.startswith("+:")}
    assert len(rules) == len(r.overrides)
    spec = detect(r.path)
    with open_quantized(spec) as ck:
        read = {p: ck.read_linear(p) for p in ck.linear_prefixes()}
    bits = {p: w.bits for p, w in read.items()}
    assert {p for p, b in bits.items() if b == 8} == set(r.overrides)
    assert set(bits.values()) == {4, 8}
    # the stored bytes of the linears are what linear_bpw counted
    from safetensors import safe_open

    stored = 0
    with safe_open(str(r.path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            if any(f".{n}." in name for n in LINEARS):
                t = f.get_tensor(name)
                stored += t.numel() * t.element_size() * 8
    n_weights = sum(w.N * w.K for w in read.values())
    assert stored / n_weights == pytest.approx(r.linear_bpw, rel=1e-6)
    # inspect counts each linear's parameters with its own bits, so the total is the dense model's
    from quantserve.formats import summarize

    assert summarize(spec).n_params == summarize(detect(d)).n_params
    types = " ".join(summarize(spec).quant_types.values())
    assert "GPTQ int4 g32" in types and "GPTQ int8 g32" in types


def test_awq_gptq_beats_rtn_and_folds_awq_scales(tmp_path: Path) -> None:
    d = _tiny_llama(tmp_path / "m", seed=1, outliers=True)
    g = _gen(9)
    calib, held_out = torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g)
    ref = _hidden(d, None, held_out)

    def err(method: str) -> tuple[float, list]:
        items = list(quantize_model(d, method, 3, 32, False, calib_tokens=calib, progress=False))
        return float((_hidden(d, items, held_out) - ref).pow(2).mean() / ref.pow(2).mean()), items

    e_rtn, _ = err("rtn")
    e_mix, items = err("awq-gptq")
    assert e_mix < 0.75 * e_rtn
    norms = {it.name: it.tensor for it in items if not isinstance(it, QuantizedLinear)}
    from safetensors.torch import load_file

    src = load_file(str(d / "model.safetensors"))
    assert not torch.equal(
        norms["model.layers.0.input_layernorm.weight"], src["model.layers.0.input_layernorm.weight"]
    )
    assert all(
        it.loss is not None for it in items if isinstance(it, QuantizedLinear)
    )  # GPTQ did the rounding


@pytest.mark.slow  # SmolLM2 writes its own calibration text, twice
def test_self_calibration_is_reproducible_and_starts_from_ordinary_tokens(smollm2_hf: Path) -> None:
    from quantserve.converters.calibration.sources import _special_ids, self_generated

    a = self_generated(smollm2_hf, 3, 24, seed=1, progress=False)
    assert a.shape == (3, 24) and a.dtype == torch.long
    # Reproducibility on one sample: with several, which sequences share a batch depends on timing, and on CPUs
    # without AVX-512 llama.cpp rounds a batch differently from a single sequence, so a near tie at temperature 1
    # went either way once here (a token of the 12th position in 3 x 24).
    b = self_generated(smollm2_hf, 1, 24, seed=1, progress=False)
    c = self_generated(smollm2_hf, 1, 24, seed=2, progress=False)
    assert torch.equal(b, self_generated(smollm2_hf, 1, 24, seed=1, progress=False)) and not torch.equal(b, c)
    special = _special_ids(smollm2_hf)
    assert special and not set(a[:, 0].tolist()) & special
    assert len({tuple(r) for r in a.tolist()}) == 3  # different samples


def test_cli_calibration_errors(tmp_path: Path, monkeypatch) -> None:
    d = _tiny_llama(tmp_path / "m")
    run = CliRunner().invoke
    base = ["convert", "--src", str(d), "--dst", str(tmp_path / "o"), "--group-size", "32", "--no-summary"]
    r = run(cli, [*base, "--quant", "gptq", "--calib", str(tmp_path / "missing.txt")])
    assert r.exit_code != 0 and "no such file" in r.output and "'self'" in r.output
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    r = run(cli, [*base, "--quant", "gptq", "--calib-dataset", "org/name"])
    assert r.exit_code != 0 and "pip install 'quantserve[datasets]'" in r.output
    r = run(cli, [*base, "--quant", "awq", "--bits-budget", "5"])
    assert r.exit_code != 0 and "--bits-budget needs a format" in r.output
    r = run(cli, [*base, "--quant", "rtn", "--bits-budget", "1.5", "--calib-samples", "2"])
    assert r.exit_code != 0 and "below" in r.output
    assert not (tmp_path / "o").exists()
