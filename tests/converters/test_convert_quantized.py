"""`quantserve convert` to and between quantized HF formats, and dequantization back to dense, on a tiny random llama."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

from quantserve.cli import main
from quantserve.formats import detect
from quantserve.formats.quant_read import open_quantized
from quantserve.quant.dequantize import dequantize_checkpoint


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def convert(*args: str) -> str:
    r = CliRunner().invoke(main, ["convert", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def linears(path) -> dict:
    with open_quantized(path) as ck:
        return {p: ck.read_linear(p) for p in ck.linear_prefixes()}


def test_rtn_to_each_format_and_repack_are_lossless(tiny_llama, tmp_path):
    convert("--src", str(tiny_llama), "--dst", str(tmp_path / "gptq"), "--quant", "rtn", "--group-size", "32")
    assert detect(tmp_path / "gptq").format == "gptq"
    ref = linears(tmp_path / "gptq")
    assert len(ref) == 2 * 7
    for fmt in ("marlin", "compressed-tensors"):
        out = convert("--src", str(tmp_path / "gptq"), "--dst", str(tmp_path / fmt), "--format", fmt)
        assert "repacked" in out and detect(tmp_path / fmt).format == fmt
        got = linears(tmp_path / fmt)
        for p, w in ref.items():
            assert torch.equal(got[p].qweight, w.qweight) and torch.equal(got[p].scales, w.scales), (fmt, p)
    # and back from Marlin to GPTQ: the same integers and scales again
    convert("--src", str(tmp_path / "marlin"), "--dst", str(tmp_path / "gptq2"), "--format", "gptq")
    for p, w in linears(tmp_path / "gptq2").items():
        assert torch.equal(w.qweight, ref[p].qweight) and torch.equal(w.scales, ref[p].scales)


def test_group_size_that_does_not_divide_k_is_refused(tiny_llama, tmp_path):
    r = CliRunner().invoke(
        main, ["convert", "--src", str(tiny_llama), "--dst", str(tmp_path / "x"), "--quant", "rtn",
               "--group-size", "96"],
    )  # fmt: skip
    assert r.exit_code == 2 and "group_size 96" in r.output and not (tmp_path / "x").exists()


def test_dequantize_gives_the_exact_weights(tiny_llama, tmp_path):
    convert("--src", str(tiny_llama), "--dst", str(tmp_path / "q"), "--quant", "rtn", "--group-size", "32",
            "--asym", "--format", "compressed-tensors")  # fmt: skip
    dense = dequantize_checkpoint(tmp_path / "q", tmp_path / "dense")
    assert detect(dense).format == "safetensors"
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    tensors = load_file(dense / "model.safetensors")
    for p, w in linears(tmp_path / "q").items():
        assert torch.equal(tensors[p + ".weight"], w.dequantize().t())
    assert torch.equal(
        tensors["model.norm.weight"], load_file(tiny_llama / "model.safetensors")["model.norm.weight"]
    )
