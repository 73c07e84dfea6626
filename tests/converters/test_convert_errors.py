"""Conversion errors a user can cause: clear typed messages, and nothing left behind when a run fails."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

from quantserve.cli.convert import convert
from quantserve.converters import gguf_to_hf, hf_to_gguf
from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf
from quantserve.errors import ConfigError, ModelFileError, UnsupportedFormatError
from quantserve.formats import read_gguf_info
from quantserve.formats.staging import ConversionError
from quantserve.gguf.safetensors_source import SafetensorsSource
from quantserve.gguf.tensors import GGUFTensorReader

pytest.importorskip("transformers")
from tests.gguf.test_convert_hf_to_gguf import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(smollm2_gguf, tmp_path_factory) -> Path:
    tok = tmp_path_factory.mktemp("tok")
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(tok)
    return make_checkpoint("llama", tmp_path_factory.mktemp("tiny"), tok)


@pytest.fixture
def copy(checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "model"))


def _fail_after(n: int, original):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > n:
            raise RuntimeError("simulated read failure")
        return original(*args, **kwargs)

    return wrapped


def test_unsupported_architecture_lists_supported(copy, tmp_path):
    config = json.loads((copy / "config.json").read_text())
    config.update(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"])
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedFormatError,
        match="gpt_bigcode.*supported model types: gemma2, gemma3, gemma3_text, gpt_oss, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, "
        "qwen3_moe",
    ):
        hf_to_gguf(copy, tmp_path / "out.gguf", "f16", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_missing_tokenizer_json(copy, tmp_path):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match="no tokenizer.json; copy the model's tokenizer.json"):
        hf_to_gguf(copy, tmp_path / "out.gguf", "q8_0", progress=False)


def test_destination_exists_needs_force(checkpoint, tmp_path):
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"keep me")
    with pytest.raises(ConfigError, match="already exists; pass --force"):
        hf_to_gguf(checkpoint, dst, "q8_0", progress=False)
    assert dst.read_bytes() == b"keep me"
    hf_to_gguf(checkpoint, dst, "q8_0", progress=False, force=True)
    assert read_gguf_info(dst).file_type == "Q8_0"


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m"])  # direct writer, and the intermediate + llama.cpp path
def test_failure_midway_leaves_nothing(quant, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(SafetensorsSource, "read", _fail_after(5, SafetensorsSource.read))
    with pytest.raises(RuntimeError, match="simulated"):
        hf_to_gguf(checkpoint, tmp_path / "out" / "m.gguf", quant, progress=False)
    assert list(tmp_path.iterdir()) == []  # no output, no temp file, not even the parent we created


def test_full_disk_is_a_clear_error(checkpoint, tmp_path, monkeypatch):
    def no_space(self, tensor, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", no_space)
    with pytest.raises(ConversionError, match="no space left on the device while writing .*m.gguf"):
        hf_to_gguf(checkpoint, tmp_path / "m.gguf", "q8_0", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_gguf_to_hf_failure_leaves_nothing(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(GGUFTensorReader, "chunks", _fail_after(20, GGUFTensorReader.chunks))
    with pytest.raises(RuntimeError, match="simulated"):
        gguf_to_hf(smollm2_gguf, tmp_path / "hf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bad_options(checkpoint, smollm2_gguf, tmp_path):
    with pytest.raises(UnsupportedFormatError, match="is a gguf model"):
        hf_to_gguf(smollm2_gguf, tmp_path / "x.gguf", "q8_0")
    with pytest.raises(ConfigError, match="--imatrix only applies to quantized types"):
        hf_to_gguf(checkpoint, tmp_path / "x.gguf", "f16", imatrix=tmp_path / "i.gguf")
    with pytest.raises(ConfigError, match="dtype 'int8'"):
        gguf_to_hf(smollm2_gguf, tmp_path / "hf", dtype="int8")
    (tmp_path / "old.dat").write_bytes(b"\x01\x00\x00\x00" * 8)
    with pytest.raises(ModelFileError, match="regenerate a legacy .dat file"):
        hf_to_gguf(checkpoint, tmp_path / "x.gguf", "q4_k_m", imatrix=tmp_path / "old.dat", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.dat"]


@pytest.mark.slow  # the CLI in processes of its own
def test_cli(checkpoint, smollm2_gguf, tmp_path):
    runner = CliRunner()
    out = tmp_path / "m.gguf"
    result = runner.invoke(convert, ["--src", str(checkpoint), "--dst", str(out), "--quant", "Q8_0"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and read_gguf_info(out).file_type == "Q8_0"
    again = runner.invoke(convert, ["--src", str(checkpoint), "--dst", str(out), "--quant", "q8_0"])
    assert again.exit_code == 2 and "already exists; pass --force" in again.output
    for args, message in (
        (["--src", str(checkpoint), "--dst", str(out), "--force"], "pass --quant"),
        (["--src", str(checkpoint), "--dst", str(out), "--dtype", "bf16"], "--dtype applies to GGUF -> HF"),
        (
            ["--src", str(smollm2_gguf), "--dst", str(tmp_path / "hf"), "--quant", "q4_0"],
            "GGUF -> HF takes --dtype",
        ),
        (["--src", str(checkpoint), "--dst", str(out), "--quant", "q9", "--force"], "unknown --quant 'q9'"),
    ):
        result = runner.invoke(convert, args)
        assert result.exit_code == 2 and message in result.output, result.output
