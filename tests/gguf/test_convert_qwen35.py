"""Qwen3.5 HF -> GGUF, dense and MoE (its experts stored apart, or stacked as transformers 5 and the released
checkpoints keep them), and as released (the text model behind a vision tower, which is left out), on
the tiny checkpoints of tests/backends/torch/test_torch_qwen35.py (two value heads per key head, so the value
heads are regrouped): the file equals what llama.cpp's own convert_hf_to_gguf.py writes with `--no-mtp`, key for
key and byte for byte, and llama.cpp runs it as transformers does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from quantserve.converters import gguf_to_hf, hf_to_gguf
from quantserve.errors import UnsupportedFormatError
from quantserve.formats import read_gguf_info
from tests.backends.torch.test_torch_qwen35 import _build
from tests.conftest import THREADS, convert_with_llama_cpp
from tests.gguf.test_convert_hf_to_gguf import tensor_bytes

llama_cpp = pytest.importorskip("llama_cpp")
IDS = [1, *range(300, 340)]
# The checkpoints carry SmolLM2's tokenizer, which transformers loads as a Qwen tokenizer for qwen3_5_moe_text, so
# the converter's tokenizer fingerprint misses it; the oracle is told its pre-tokenizer (the GGUFs' vocab is
# compared all the same). `--no-mtp`: the tiny models have no multi-token-prediction head, which the converter
# otherwise requires.
ORACLE = '''"""convert_hf_to_gguf.py --no-mtp, with SmolLM2's pre-tokenizer named."""
import runpy, sys
from pathlib import Path

sys.path.insert(0, str(Path(sys.argv[1]).parent))
from conversion.base import TextModel

TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = [*sys.argv[1:], "--no-mtp"]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.fixture(scope="module")
def checkpoints(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    return {
        kind: _build(kind, smollm2_gguf, tmp_path_factory) for kind in ("dense", "moe", "released", "packed")
    }


@pytest.fixture(scope="module")
def oracles(vendored, checkpoints, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("oracle-qwen35")
    (tmp / "oracle.py").write_text(ORACLE)
    return {
        k: convert_with_llama_cpp(vendored, src, tmp / f"{k}.gguf", tmp, wrapper=tmp / "oracle.py")
        for k, src in checkpoints.items()
    }


@pytest.mark.parametrize(
    ("kind", "arch"),
    [("dense", "qwen35"), ("moe", "qwen35moe"), ("released", "qwen35"), ("packed", "qwen35moe")],
)
def test_gguf_equals_convert_hf_to_gguf(kind, arch, checkpoints, oracles, tmp_path):
    ours = hf_to_gguf(checkpoints[kind], tmp_path / "ours.gguf", "f16", progress=False)
    kv, ref = read_gguf_info(ours).metadata, read_gguf_info(oracles[kind]).metadata
    # the vendored gguf-py's SpecialVocab also writes add_eos_token = False (test_convert_llava says why)
    expected = {k: v for k, v in ref.items() if k != "tokenizer.ggml.add_eos_token"}
    assert list(kv) == list(expected) and kv == expected
    assert list(tensor_bytes(ours).items()) == list(tensor_bytes(oracles[kind]).items())
    assert kv[f"{arch}.attention.recurrent_layers"] == [True, True, True, False]
    types = {t.name: (t.type_name, t.shape) for t in read_gguf_info(ours).tensors}
    assert types["blk.0.ssm_conv1d.weight"] == ("F32", (4, 128)) and types["blk.0.ssm_a"] == ("F32", (4,))


def test_a_multi_token_prediction_head_is_left_out(checkpoints, tmp_path):
    """Released Qwen3.5 checkpoints carry an MTP head (`mtp.*`), which the torch backend does not run: the GGUF is
    the same without it, as the converter's `--no-mtp` writes it."""
    from safetensors.torch import load_file, save_file

    src = Path(shutil.copytree(checkpoints["dense"], tmp_path / "m"))
    weights = load_file(src / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    weights["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                 "mtp_num_hidden_layers": 1}))  # fmt: skip
    with_mtp = hf_to_gguf(src, tmp_path / "a.gguf", "f16", progress=False)
    plain = hf_to_gguf(checkpoints["dense"], tmp_path / "b.gguf", "f16", progress=False)
    assert list(tensor_bytes(with_mtp).items()) == list(tensor_bytes(plain).items())


@pytest.mark.parametrize("kind", ["dense", "moe", "packed"])
def test_llama_cpp_runs_it_as_transformers_does(kind, checkpoints, tmp_path):
    out = hf_to_gguf(checkpoints[kind], tmp_path / "m.gguf", "f16", progress=False)
    llm = llama_cpp.Llama(
        str(out), n_ctx=128, flash_attn=False, n_threads=THREADS, verbose=False, logits_all=True
    )
    llm.eval(IDS)
    ours = np.asarray(llm.scores[: len(IDS)])
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    assert (
        np.abs(ours - ref).mean() / np.abs(ref).mean() < 3e-2
    )  # F16 weights and KV; measured 0.3 % and 1.5 %
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    want = model.generate(torch.tensor([IDS[:6]]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 6:]
    got = [t for _, t in zip(range(10), llm.generate(IDS[:6], temp=0.0, reset=True), strict=False)]
    assert got == want.tolist()


def test_gguf_to_hf_is_refused_by_name(checkpoints, tmp_path):
    out = hf_to_gguf(checkpoints["dense"], tmp_path / "m.gguf", "f16", progress=False)
    with pytest.raises(
        UnsupportedFormatError, match="qwen35, which quantserve does not convert from GGUF to HF"
    ):
        gguf_to_hf(out, tmp_path / "hf")


def test_quantserve_run_serves_it_through_llama_cpp(checkpoints, tmp_path):
    """No GPU here: `quantserve run` converts the HF directory at load (q8_0) and llama.cpp serves it to the official
    client."""
    pytest.importorskip("openai")
    from tests.conftest import ask_openai, start_server

    srv = start_server(tmp_path, str(checkpoints["moe"]), "--no-cache", "--cache-dir", str(tmp_path / "c"))
    ask_openai(srv)
    assert "after conversion to GGUF" in srv.log()
