"""HF -> GGUF on tiny random-weight llama / qwen2 / qwen3 checkpoints, checked against transformers and llama.cpp."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from quantserve.converters import gguf_to_hf, hf_to_gguf
from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf
from quantserve.formats import read_gguf_info
from quantserve.gguf.native_quant import quantize_file
from quantserve.gguf.quant_types import QUANTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")
# One llama.cpp thread: on this 2-core box a second thread that shares a core with anything else turns every
# barrier into a wait (measured 66 s vs 9 s for 16 tokens under load); greedy results do not depend on it.
THREADS = 1

IDS = [504, 3575, 282, 4649, 314, 7042, 30, 198]  # "The capital of France is Paris.\n" in SmolLM2's vocab
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)  # fmt: skip
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": False}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {"tie_word_embeddings": False, "head_dim": 32},
    ),
}


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files, rebuilt from the GGUF (the vocab must match the 49152-row embedding)."""
    d = tmp_path_factory.mktemp("tokenizer")
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(d)
    return d


def make_checkpoint(arch: str, directory: Path, tokenizer_dir: Path, max_shard_size: str = "5GB") -> Path:
    config_cls, model_cls, extra = MODELS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SIZES, **extra))
    with torch.no_grad():  # weights large enough that logits are far from uniform
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 if p.ndim == 2 else 1 + 0.1 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size=max_shard_size)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    # llama is saved in shards (with model.safetensors.index.json) to exercise the sharded reader
    return {
        a: make_checkpoint(a, tmp_path_factory.mktemp(a), tokenizer_dir, "10MB" if a == "llama" else "5GB")
        for a in MODELS
    }


def llama_logits(path: Path) -> np.ndarray:
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, flash_attn=False, n_threads=THREADS, verbose=False, logits_all=True
    )
    llm.eval(IDS)
    return np.asarray(llm.scores[: len(IDS)])


def hf_logits(directory: Path) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


def tensor_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    info = read_gguf_info(path)
    mm = np.memmap(path, np.uint8, mode="r")
    return {t.name: (t.type_name, mm[t.offset : t.offset + t.n_bytes].tobytes()) for t in info.tensors}


@pytest.mark.parametrize("arch", list(MODELS))
def test_f16_logits_match_transformers(arch, checkpoints, tmp_path):
    out = hf_to_gguf(checkpoints[arch], tmp_path / "m.gguf", "F16", progress=False)
    info = read_gguf_info(out)
    assert info.architecture == arch and info.file_type == "F16"
    assert info.get(f"{arch}.attention.head_count_kv") == 2 and info.get("tokenizer.ggml.pre") == "smollm"
    names = {t.name for t in info.tensors}
    assert ("output.weight" in names) == (arch != "qwen2")  # qwen2 fixture has tied embeddings
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2") and ("blk.0.attn_q_norm.weight" in names) == (
        arch == "qwen3"
    )
    if arch == "qwen3":  # head_dim 32 != 256 / 4
        assert info.get("qwen3.attention.key_length") == 32
    ours, ref = llama_logits(out), hf_logits(checkpoints[arch])
    assert (
        np.abs(ours - ref).mean() / np.abs(ref).mean() < 5e-3
    )  # measured ~1.3e-3 (F16 weights and KV cache)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_q4_k_m_uses_llama_cpp_mix(checkpoints, tmp_path):
    out = hf_to_gguf(checkpoints["llama"], tmp_path / "m.gguf", "q4k", progress=False)
    info = read_gguf_info(out)
    types = {t.name: t.type_name for t in info.tensors}
    assert info.get("general.file_type") == 15 and info.file_type == "Q4_K_M"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    # llama.cpp's use_more_bits(i, n): with 2 layers only layer 1 (i >= 7n/8) gets Q6_K attn_v / ffn_down
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert not [p for p in tmp_path.iterdir() if p.name != "m.gguf"]  # the BF16 intermediate is gone
    ours, ref = llama_logits(out), hf_logits(checkpoints["llama"])
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.9  # 4-bit random weights: measured ~0.96
    # and back: the K-quant blocks dequantize (gguf-py) to the weights llama.cpp computes with
    back = hf_logits(gguf_to_hf(out, tmp_path / "hf", dtype="fp32", progress=False))
    assert np.corrcoef(back.ravel(), ours.ravel())[0, 1] > 0.999


@pytest.mark.parametrize("quant", ["q4_0", "q5_1", "q8_0"])
def test_direct_types_equal_llama_quantize(quant, checkpoints, tmp_path):
    """Our direct writer (gguf-py + ggml's Q6_K for output.weight) == llama-quantize on an F32 GGUF."""
    f32 = hf_to_gguf(checkpoints["llama"], tmp_path / "f32.gguf", "f32", progress=False)
    quantize_file(f32, tmp_path / "ref.gguf", QUANTS[quant], verbose=False)
    ours = tensor_bytes(hf_to_gguf(checkpoints["llama"], tmp_path / "ours.gguf", quant, progress=False))
    ref = tensor_bytes(tmp_path / "ref.gguf")
    assert ours.keys() == ref.keys()
    assert ours["output.weight"][0] == ("Q8_0" if quant == "q8_0" else "Q6_K")
    for name in ref:
        assert ours[name] == ref[name], name


def _write_imatrix(path: Path, model_gguf: Path) -> None:
    w = gguf.GGUFWriter(
        path, arch="imatrix"
    )  # what llama-imatrix writes (common/imatrix-loader.cpp reads it)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["test.txt"])
    w.add_uint32("imatrix.chunk_count", 4)
    w.add_uint32("imatrix.chunk_size", 512)
    rng = np.random.default_rng(1)
    for t in read_gguf_info(model_gguf).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            w.add_tensor(f"{t.name}.in_sum2", (rng.random((1, t.shape[0])) * 10).astype(np.float32))
            w.add_tensor(f"{t.name}.counts", np.full((1, 1), 4.0, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_imatrix_reaches_llama_cpp(checkpoints, tmp_path):
    plain = hf_to_gguf(checkpoints["llama"], tmp_path / "plain.gguf", "q4_k_m", progress=False)
    _write_imatrix(tmp_path / "imatrix.gguf", plain)
    out = hf_to_gguf(
        checkpoints["llama"],
        tmp_path / "im.gguf",
        "q4_k_m",
        imatrix=tmp_path / "imatrix.gguf",
        progress=False,
    )
    info = read_gguf_info(out)
    assert info.get("quantize.imatrix.entries_count") == 2 * 7 + 1  # 7 matrices per layer, and output.weight
    assert (
        info.get("quantize.imatrix.dataset") == "test.txt" and info.get("quantize.imatrix.chunks_count") == 4
    )
    a, b = tensor_bytes(plain), tensor_bytes(out)
    assert a["blk.0.attn_q.weight"] != b["blk.0.attn_q.weight"]  # the importance weights changed the rounding
    assert a["token_embd.weight"] == b["token_embd.weight"]  # no imatrix entry for it


# the main matrix type of each i-quant file (llama-quant.cpp's llama_ftype_get_default_type), which the tiny
# models' rows (multiples of 256) take without falling back
I_QUANTS = {"iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL", "iq3_m": "IQ3_S", "iq3_s": "IQ3_S", "iq3_xs": "IQ3_S",
            "iq3_xxs": "IQ3_XXS", "iq2_m": "IQ2_S", "iq2_s": "IQ2_XS", "iq2_xs": "IQ2_XS", "iq2_xxs": "IQ2_XXS",
            "iq1_m": "IQ1_M", "iq1_s": "IQ1_S"}  # fmt: skip


@pytest.fixture(scope="module")
def tied_f32(checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny qwen2 (tied embeddings: no 49152-row output matrix to quantize twice per type) as an F32 GGUF, and
    an importance matrix for it."""
    d = tmp_path_factory.mktemp("f32")
    f32 = hf_to_gguf(checkpoints["qwen2"], d / "f32.gguf", "f32", progress=False)
    _write_imatrix(d / "imatrix.gguf", f32)
    return f32, d / "imatrix.gguf"


@pytest.mark.parametrize("quant", ["iq4_xs", "iq3_xxs", "iq2_m", "iq1_s"])
def test_i_quants_equal_llama_quantize_with_the_same_imatrix(quant, checkpoints, tied_f32, tmp_path):
    """An i-quant written from the checkpoint with an importance matrix is llama-quantize's file for the F32 GGUF
    and the same matrix, tensor for tensor (llama.cpp's quantizer and its per-tensor type rules). One type of each
    family here; every type's file type and imatrix rule are checked against llama.cpp below."""
    f32, im = tied_f32
    quantize_file(f32, tmp_path / "ref.gguf", QUANTS[quant], imatrix=im, nthread=THREADS, verbose=False)
    out = hf_to_gguf(
        checkpoints["qwen2"], tmp_path / "ours.gguf", quant, imatrix=im, nthread=THREADS, progress=False
    )
    ours, ref = tensor_bytes(out), tensor_bytes(tmp_path / "ref.gguf")
    assert ours.keys() == ref.keys()
    for name in ref:
        assert ours[name] == ref[name], name
    assert ours["blk.1.ffn_gate.weight"][0] == I_QUANTS[quant]
    assert read_gguf_info(out).file_type == quant.upper()


@pytest.mark.parametrize("quant", [*I_QUANTS, "q2_k_s"])
def test_each_type_is_llama_cpps_and_needs_an_imatrix_where_llama_cpp_does(
    quant, checkpoints, tied_f32, tmp_path
):
    """Each name is llama.cpp's file type of that name (llama.h's enum, as llama-cpp-python exposes it). Without an
    importance matrix, llama.cpp refuses exactly the types we refuse up front, naming an offending tensor; we say how
    to get a matrix, and write nothing."""
    from quantserve.errors import ConfigError
    from quantserve.formats.staging import ConversionError

    target = QUANTS[quant]
    assert int(target.ftype) == getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    f32, _ = tied_f32
    if target.needs_imatrix:
        with pytest.raises(ConversionError):
            quantize_file(f32, tmp_path / "x.gguf", target, nthread=THREADS, verbose=False)
        with pytest.raises(ConfigError, match="needs an importance matrix.*--calib builtin.*--imatrix FILE"):
            hf_to_gguf(checkpoints["qwen2"], tmp_path / "y.gguf", quant, progress=False)
        assert not (tmp_path / "y.gguf").exists()
    else:
        quantize_file(f32, tmp_path / "x.gguf", target, nthread=THREADS, verbose=False)
        assert read_gguf_info(tmp_path / "x.gguf").file_type == quant.upper()


def test_calib_makes_the_importance_matrix_an_i_quant_needs(checkpoints, tmp_path):
    """`convert --quant iq2_xxs --calib builtin`: quantserve computes the matrix from the calibration tokens and
    llama.cpp quantizes with it; GPTQ rounds none of the i-quant tensors, and the report says so."""
    from click.testing import CliRunner

    from quantserve.cli import main

    out = tmp_path / "c.gguf"
    args = ["convert", "--src", str(checkpoints["llama"]), "--dst", str(out), "--quant", "iq2_xxs", "--calib",
            "builtin", "--calib-samples", "1", "--calib-seq-len", "64", "--threads", "1", "--no-summary"]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "IQ2_XXS with GPTQ's codes in" in r.output and "kept llama.cpp's codes" in r.output, r.output
    info = read_gguf_info(out)
    assert (
        info.get("quantize.imatrix.file") == "quantserve"
        and info.get("quantize.imatrix.entries_count") == 14  # 7 linears a layer (not output.weight)
    )
    assert tensor_bytes(out)["blk.1.ffn_gate.weight"][0] == "IQ2_XXS"


def _weights(directory: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({k: f.get_tensor(k).float().numpy() for k in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("arch", list(MODELS))
def test_hf_gguf_hf_round_trip_is_exact(arch, checkpoints, tmp_path):
    """F32 GGUF and fp32 HF hold bf16 values exactly: names, q/k permutations, biases and norms must survive."""
    gguf_path = hf_to_gguf(checkpoints[arch], tmp_path / "m.gguf", "f32", progress=False)
    back = gguf_to_hf(gguf_path, tmp_path / "hf", dtype="fp32", progress=False)
    original, ours = _weights(checkpoints[arch]), _weights(back)
    assert ours.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    np.testing.assert_allclose(hf_logits(back), hf_logits(checkpoints[arch]), rtol=1e-4, atol=1e-4)


def test_mistral_converts_as_llama(checkpoints, tmp_path):
    src = Path(shutil.copytree(checkpoints["llama"], tmp_path / "mistral"))
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (src / "config.json").write_text(json.dumps(config))
    info = read_gguf_info(hf_to_gguf(src, tmp_path / "m.gguf", "q8_0", progress=False))
    assert info.architecture == "llama" and info.file_type == "Q8_0"
    assert tensor_bytes(tmp_path / "m.gguf") == tensor_bytes(
        hf_to_gguf(checkpoints["llama"], tmp_path / "l.gguf", "q8_0", progress=False)
    )
