"""Qwen3-MoE on a GPU (bench/gpu/run.sh runs these with the other `cuda` tests): int4 experts at load stacked for
the grouped kernel (kernels/w4a16_moe.py), its logits against transformers on the dequantized weights, and its
decode step in CUDA graphs against eager steps. Skipped without CUDA."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
import triton  # noqa: F401 - before TRITON_INTERPRET is touched (see tests/kernels/test_w4a16_kernels.py)

from quantserve.backends.torch.fuse import fuse_projections
from quantserve.backends.torch.weights import load_model
from quantserve.formats import detect
from tests.backends.torch.test_cuda import generate, staged_gptq
from tests.backends.torch.test_torch_engine import PROMPTS
from tests.backends.torch.test_torch_moe import _dequantized_copy, save_tiny_moe

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE (fp16-exact weights: int4 at load in fp16 quantizes what the fp32 reference does), with
    SmolLM2's tokenizer from the staged GPTQ model when it is there."""
    d = save_tiny_moe(tmp_path_factory.mktemp("qwen3moe"), half_exact=True)
    if (src := staged_gptq()) is not None:
        for f in src.glob("*tok*"):
            shutil.copy(f, d / f.name)
    return d


def _int4(d: Path):
    model = load_model(detect(d), dtype=torch.float16, device=torch.device("cuda"), quant="int4")
    fuse_projections(model)
    assert all(layer.mlp.grouped is not None for layer in model.model.layers)
    return model


def test_grouped_int4_matches_transformers_on_the_device(moe_dir, tmp_path):
    ours = _int4(moe_dir)
    ours.use_fused_kernels(True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        _dequantized_copy(moe_dir, tmp_path / "dq")
    ).eval()
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours.compute_logits(ours(ids.cuda())).cpu()
    # fp16 activations through two routed layers (the dense test's 8e-3 of the scale, plus routing's share:
    # measured 9.1e-3 on the CPU's fp16 path); the mean holds the whole logit matrix to 3e-4 (measured there)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1.5e-2 * scale
    assert (got - want).abs().mean().item() < 1e-3 * scale


def test_grouped_moe_graphs_give_the_eager_tokens(moe_dir):
    if not (moe_dir / "tokenizer.json").is_file():
        pytest.skip("no tokenizer: SmolLM2 GPTQ not staged (bench/gpu/stage.py; QUANTSERVE_GPU_MODEL)")
    from quantserve.backends.torch.tokenizer import HFTokenizer

    parts = (_int4(moe_dir), HFTokenizer.from_dir(moe_dir))
    eager, _ = generate(parts, PROMPTS, 4, graphs=False)
    graphs, _ = generate(parts, PROMPTS, 4, graphs=True)  # asserts that the runner captured graphs
    assert graphs == eager
