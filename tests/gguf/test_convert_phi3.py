"""HF <-> GGUF for Phi-3 (fused q|k|v and gate|up, LongRoPE's two factor sets) on tiny random-weight checkpoints with
SmolLM2's tokenizer (as a GPT2Tokenizer, the Phi-4 setup): the GGUF equals convert_hf_to_gguf.py's key for key and
byte for byte, llama.cpp runs it as transformers does, and GGUF -> HF gives the same logits back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from quantserve.converters import gguf_to_hf, hf_to_gguf
from quantserve.errors import ModelFileError
from quantserve.formats import read_gguf_info
from tests.conftest import convert_with_llama_cpp
from tests.gguf.test_convert_hf_to_gguf import IDS, SIZES, _weights, llama_logits, tensor_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

# LongRoPE over a 256-token original context, stretched to 1024: 32 factors, one per rotated pair of a 64-wide head
LONGROPE = dict(
    max_position_embeddings=1024, original_max_position_embeddings=256,
    rope_scaling={"rope_type": "longrope", "long_factor": [1.0 + 0.1 * i for i in range(32)],
                  "short_factor": [1.0 + 0.01 * i for i in range(32)]},
)  # fmt: skip
VARIANTS = {"phi3": {}, "phi3-longrope": LONGROPE}


@pytest.fixture(scope="module")
def checkpoints(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    tok = tmp_path_factory.mktemp("tokenizer")
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(tok)
    out = {}
    for name, extra in VARIANTS.items():
        torch.manual_seed(0)
        config = transformers.Phi3Config(**{**SIZES, **extra}, pad_token_id=2, tie_word_embeddings=False)
        model = transformers.Phi3ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.08 if p.ndim >= 2 else 1 + 0.1 * torch.randn_like(p))
        # not named after Phi: llama.cpp looks up Phi-3's <|end|> token in any model whose general.name (the
        # directory's) says "phi", and SmolLM2's vocabulary has none
        d = tmp_path_factory.mktemp(f"tiny-{len(out)}")
        model.to(torch.bfloat16).save_pretrained(d)
        for f in tok.iterdir():
            shutil.copy(f, d / f.name)
        tc = json.loads(
            (d / "tokenizer_config.json").read_text()
        )  # Phi3MiniModel reads a GPT2Tokenizer's BPE
        (d / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "GPT2Tokenizer"}))
        out[name] = d
    return out


@pytest.fixture(scope="module")
def oracles(vendored, checkpoints, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("oracle")
    return {
        name: convert_with_llama_cpp(vendored, src, tmp / f"{name}-f16.gguf", tmp)
        for name, src in checkpoints.items()
    }


def hf_logits(directory: Path, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("name", VARIANTS)
def test_gguf_equals_convert_hf_to_gguf(name, checkpoints, oracles, tmp_path):
    ours = hf_to_gguf(checkpoints[name], tmp_path / "ours.gguf", "f16", progress=False)
    kv, ref = read_gguf_info(ours).metadata, read_gguf_info(oracles[name]).metadata
    expected = {k: v for k, v in ref.items() if k != "tokenizer.ggml.add_eos_token"}  # see test_convert_llava
    assert list(kv) == list(expected) and kv == expected
    assert list(tensor_bytes(ours).items()) == list(tensor_bytes(oracles[name]).items())
    names = {t.name for t in read_gguf_info(ours).tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names and "blk.0.attn_q.weight" not in names
    assert ("rope_factors_long.weight" in names) == (name == "phi3-longrope")


@pytest.mark.parametrize("name", VARIANTS)
def test_llama_cpp_runs_it_as_transformers_does(name, checkpoints, tmp_path):
    out = hf_to_gguf(checkpoints[name], tmp_path / "m.gguf", "f16", progress=False)
    ours, ref = llama_logits(out), hf_logits(checkpoints[name], IDS)
    assert np.abs(ours - ref).mean() / np.abs(ref).mean() < 5e-3  # F16 weights and KV cache
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", VARIANTS)
def test_gguf_to_hf_round_trip_is_exact(name, checkpoints, tmp_path):
    """320 tokens: past the LongRoPE model's 256-token original context, where transformers takes the long
    factors, which must come back from their tensors into rope_scaling."""
    src = checkpoints[name]
    back = gguf_to_hf(hf_to_gguf(src, tmp_path / "m.gguf", "f32", progress=False), tmp_path / "hf", "fp32")
    original, ours = _weights(src), _weights(back)
    assert ours.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    ids = IDS * 40
    np.testing.assert_allclose(hf_logits(back, ids), hf_logits(src, ids), rtol=1e-4, atol=1e-4)


def test_rope_factors_of_the_wrong_length_are_refused(checkpoints, tmp_path):
    src = Path(shutil.copytree(checkpoints["phi3-longrope"], tmp_path / "bad"))
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"]["short_factor"] = config["rope_parameters"]["short_factor"][:-1]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="long_factor and short_factor must both hold 32 values"):
        hf_to_gguf(src, tmp_path / "m.gguf", "f16", progress=False)
    assert not (tmp_path / "m.gguf").exists()
