"""HF <-> GGUF for the mixture-of-experts families (Qwen3-MoE, Mixtral), on tiny random-weight checkpoints: the GGUF
equals what llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist) writes, key for key and byte for
byte, with each layer's experts stacked; llama.cpp runs it as transformers does; GGUF -> HF gives it back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from quantserve.converters import gguf_to_hf, hf_to_gguf
from quantserve.errors import UnsupportedFormatError
from quantserve.formats import read_gguf_info
from tests.conftest import convert_with_llama_cpp
from tests.gguf.test_convert_hf_to_gguf import SIZES, _weights, hf_logits, llama_logits, tensor_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

EXPERTS = 4


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_gguf, tmp_path_factory) -> Path:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    d = tmp_path_factory.mktemp("tokenizer")
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(d)
    return d


FAMILIES = {
    # 4 experts and top-2 routing, renormalised as the released Qwen3 MoE models are
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **SIZES, head_dim=32, moe_intermediate_size=128, num_experts=EXPERTS, num_experts_per_tok=2,
            norm_topk_prob=True, tie_word_embeddings=False,
        )
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **{**SIZES, "intermediate_size": 128}, num_local_experts=EXPERTS, num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    ),
}  # fmt: skip
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


@pytest.fixture(scope="module")
def checkpoints(tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family, build in FAMILIES.items():
        torch.manual_seed(0)
        model = build()
        with torch.no_grad():  # weights large enough that the logits are far from uniform
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.08 if p.ndim >= 2 else 1 + 0.1 * torch.randn_like(p))
        d = tmp_path_factory.mktemp(family)
        model.to(torch.bfloat16).save_pretrained(d)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, d / f.name)
        out[family] = d
    return out


@pytest.fixture(scope="module")
def moe(checkpoints) -> Path:
    return checkpoints["qwen3_moe"]


@pytest.fixture(scope="module")
def oracles(vendored, checkpoints, tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's convert_hf_to_gguf.py on each (an empty `sentencepiece` stands in for the one it imports)."""
    tmp = tmp_path_factory.mktemp("oracle-moe")
    return {
        family: convert_with_llama_cpp(vendored, src, tmp / f"{family}-f16.gguf", tmp)
        for family, src in checkpoints.items()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_equals_convert_hf_to_gguf(family, checkpoints, oracles, tmp_path):
    ours = hf_to_gguf(checkpoints[family], tmp_path / "ours.gguf", "f16", progress=False)
    kv, ref = read_gguf_info(ours).metadata, read_gguf_info(oracles[family]).metadata
    # the vendored gguf-py's SpecialVocab also writes add_eos_token = False (test_convert_llava says why)
    expected = {k: v for k, v in ref.items() if k != "tokenizer.ggml.add_eos_token"}
    assert list(kv) == list(expected) and kv == expected
    arch = GGUF_ARCH[family]
    assert kv[f"{arch}.expert_count"] == EXPERTS and kv[f"{arch}.expert_used_count"] == 2
    assert list(tensor_bytes(ours).items()) == list(tensor_bytes(oracles[family]).items())
    shapes = {t.name: (t.type_name, t.shape) for t in read_gguf_info(ours).tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == ("F16", (256, 128, EXPERTS))
    assert shapes["blk.0.ffn_down_exps.weight"] == ("F16", (128, 256, EXPERTS))
    assert shapes["blk.1.ffn_gate_inp.weight"] == ("F32", (256, EXPERTS))  # the router stays F32


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_it_as_transformers_does(family, checkpoints, tmp_path):
    out = hf_to_gguf(checkpoints[family], tmp_path / "m.gguf", "f16", progress=False)
    ours, ref = llama_logits(out), hf_logits(checkpoints[family])
    assert np.abs(ours - ref).mean() / np.abs(ref).mean() < 5e-3  # F16 weights and KV cache
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_to_hf_unstacks_the_experts_exactly(family, checkpoints, tmp_path):
    src = checkpoints[family]
    back = gguf_to_hf(hf_to_gguf(src, tmp_path / "m.gguf", "f32", progress=False), tmp_path / "hf", "fp32")
    original, ours = _weights(src), _weights(back)
    assert ours.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    config = json.loads((back / "config.json").read_text())
    assert (config["model_type"], config["num_experts_per_tok"]) == (family, 2)
    assert config.get("num_experts", config.get("num_local_experts")) == EXPERTS
    np.testing.assert_allclose(hf_logits(back), hf_logits(src), rtol=1e-4, atol=1e-4)


def _copy(moe: Path, to: Path, config: dict | None = None, drop: str | None = None) -> Path:
    d = Path(shutil.copytree(moe, to))
    if config:
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
    if drop:
        from safetensors.torch import load_file, save_file

        weights = load_file(d / "model.safetensors")
        del weights[drop]
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_a_missing_expert_is_named_and_nothing_is_written(moe, tmp_path):
    src = _copy(moe, tmp_path / "m", drop="model.layers.1.mlp.experts.2.up_proj.weight")
    with pytest.raises(
        UnsupportedFormatError, match=r"lacks 'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'"
    ):
        hf_to_gguf(src, tmp_path / "m.gguf", "f16", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_fewer_experts_in_the_config_than_in_the_checkpoint_is_an_error(moe, tmp_path):
    src = _copy(moe, tmp_path / "m", config={"num_local_experts": 3})  # transformers 5 writes this name
    with pytest.raises(UnsupportedFormatError, match="expert 3, but config.json has 3 experts"):
        hf_to_gguf(src, tmp_path / "m.gguf", "f16", progress=False)


@pytest.mark.parametrize(
    ("change", "words"),
    [({"norm_topk_prob": False}, "norm_topk_prob false"), ({"mlp_only_layers": [1]}, "dense layers")],
)
def test_a_model_llama_cpp_would_run_differently_is_refused(moe, tmp_path, change, words):
    src = _copy(moe, tmp_path / "m", config=change)
    with pytest.raises(UnsupportedFormatError, match=words):
        hf_to_gguf(src, tmp_path / "m.gguf", "f16", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_quantserve_run_serves_the_hf_directory_in_situ(moe, tmp_path):
    """`quantserve run HF_DIR --quant q8_0` on this CPU: converted at load, served through llama.cpp, and asked
    through the official client. (Its greedy tokens are not compared: a random model's near-ties flip with the
    thread count; test_llama_cpp_runs_it_as_transformers_does compares the logits.)"""
    pytest.importorskip("openai")
    from tests.conftest import ask_openai, start_server

    srv = start_server(
        tmp_path, str(moe), "--quant", "q8_0", "--no-cache", "--cache-dir", str(tmp_path / "c")
    )
    ask_openai(srv)
    assert "after conversion to GGUF (q8_0)" in srv.log()


def test_inspect_names_the_experts_of_both_forms(moe, checkpoints, tmp_path):
    from quantserve.formats.summary import render_summary, summarize

    # 2 layers x (4 - 2) idle experts x 3 matrices of 256 x 128 are not active for a token
    want = "4 experts, 2 routed per token: 25.8M of 26.2M parameters active"
    gguf_path = hf_to_gguf(moe, tmp_path / "m.gguf", "q8_0", progress=False)
    for path in (moe, gguf_path):
        s = summarize(path)
        assert s.experts == want and "experts:" in render_summary(s)
    mixtral = hf_to_gguf(checkpoints["mixtral"], tmp_path / "x.gguf", "q8_0", progress=False)
    assert summarize(mixtral).experts.startswith("4 experts, 2 routed per token")  # feed_forward_length wide
    assert summarize(moe).n_params - 2 * 2 * 3 * 256 * 128 == 25_759_104


def test_a_missing_mixtral_expert_is_named_as_its_checkpoint_names_it(checkpoints, tmp_path):
    src = _copy(
        checkpoints["mixtral"], tmp_path / "m", drop="model.layers.0.block_sparse_moe.experts.1.w3.weight"
    )
    with pytest.raises(
        UnsupportedFormatError, match=r"lacks 'model\.layers\.0\.block_sparse_moe\.experts\.1\.w3"
    ):
        hf_to_gguf(src, tmp_path / "m.gguf", "f16", progress=False)
