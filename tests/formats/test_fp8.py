"""FP8 checkpoints as the official releases lay them out (`quant_method: fp8`, 128×128 `weight_scale_inv` blocks):
detected and inspected from their headers, served by the torch backend with the weights kept in FP8 (logits equal
transformers running the same checkpoint), and by llama.cpp through an exact dequantization and Q8_0; a damaged
one is refused before anything loads, naming the tensor and the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantserve.backends.torch.float_linear import Fp8Linear, Mxfp4Linear, Nvfp4Linear
from quantserve.backends.torch.quant_linear import QuantLinear
from quantserve.backends.torch.weights import load_model
from quantserve.cli import main
from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats import detect
from tests.backends.torch.test_torch_engine import greedy_chat
from tests.fixtures.fp8 import write_compressed, write_fp8

CPU = torch.device("cpu")
PRESETS = (
    "FP8",
    "FP8_DYNAMIC",
    "FP8_BLOCK",
    "MXFP4A16",
    "NVFP4A16",
    "W8A8",
)  # llm-compressor's, as compressed-tensors writes them
PROMPT = [1, 504, 3458, 282, 4649, 314, 8241, 30, 2]


@pytest.fixture(scope="module")
def fp8(tiny_llama_hf, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama (hidden 128, ffn 256, k/v 64 rows) with 128×128 blocks, with 32×64 blocks (a grid of
    scales over every matrix) and with one scale per tensor; a tiny Qwen3-MoE with FP8 experts."""
    d = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    moe = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=32,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(moe).save_pretrained(d / "qwen3-moe")
    return {
        "b128": write_fp8(tiny_llama_hf, d / "b128", (128, 128)),
        "b32x64": write_fp8(tiny_llama_hf, d / "b32x64", (32, 64)),
        "tensor": write_fp8(tiny_llama_hf, d / "tensor", None),
        # every expert FP8, the router not
        "qwen3-moe": write_fp8(d / "qwen3-moe", d / "qwen3-moe-fp8", (32, 32)),
        # compressed-tensors, as llm-compressor writes its presets
        **{p: write_compressed(tiny_llama_hf, d / p, p) for p in PRESETS},
    }


def test_detect_reads_the_scheme_from_the_config_and_headers(fp8):
    spec = detect(fp8["b128"])
    assert spec.format == "fp8"
    assert spec.quant == {"fmt": "e4m3", "weight_block_size": (128, 128), "activation_scheme": "dynamic"}
    assert spec.scheme.summary() == "FP8 e4m3 (128×128 block scales, dynamic activations)"
    assert detect(fp8["tensor"]).scheme.summary() == "FP8 e4m3 (one scale per tensor, dynamic activations)"
    assert spec.scheme.repack_targets() == ()  # no integer layout holds FP8 values


def test_inspect_shows_the_scheme_and_both_backends_plans(fp8):
    out = CliRunner().invoke(main, ["inspect", str(fp8["b32x64"])]).output
    assert "weight_block_size=(32, 64)" in out and "q_proj: F8_E4M3" in out
    assert "dequantize the FP8 e4m3 (32×64 block scales, dynamic activations) weights exactly to fp32" in out
    assert "convert to GGUF q8_0" in out
    out = CliRunner().invoke(main, ["inspect", str(fp8["b32x64"]), "--backend", "torch"]).output
    assert "keep them as they ship (1 byte a weight), each matmul decoding them" in out, out


@pytest.mark.parametrize(
    "kind",
    [
        "b128",
        "b32x64",
        "tensor",
        "qwen3-moe",
        "FP8",
        "FP8_DYNAMIC",
        "FP8_BLOCK",
        "MXFP4A16",
        "NVFP4A16",
        "W8A8",
    ],
)
def test_torch_logits_equal_transformers_on_the_same_checkpoint(kind, fp8, tmp_path):
    """transformers reads the checkpoint itself (on a CPU it dequantizes at load, in fp32 here): the oracle for
    which scale covers which weight. Ours keeps the file's bytes and decodes them in the matmul. NVFP4 is the
    exception: compressed-tensors decompresses it to bf16, so transformers runs our exact fp32 dequantization instead
    (that the two agree but for bf16's rounding is test_dequantization_is_exactly_what_transformers_computes)."""
    from quantserve.quant.dequantize import dequantize_checkpoint

    model = load_model(detect(fp8[kind]), dtype=torch.float32, device=CPU)
    if kind == "NVFP4A16":
        ref = _transformers(dequantize_checkpoint(fp8[kind], tmp_path / "dense"))
    else:
        ref = _transformers(fp8[kind])
    ids = torch.tensor([[t % 256 for t in PROMPT]])  # in the tiny Qwen3-MoE's vocab too
    with torch.no_grad():
        want = ref(ids).logits[0]
        got = model.compute_logits(model(ids)[0])
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    down = "model.layers.1.mlp." + ("experts.3.down_proj" if kind == "qwen3-moe" else "down_proj")
    q = model.get_submodule(down)
    shipped = load_file(fp8[kind] / "model.safetensors")
    if kind == "NVFP4A16":  # the shipped bytes: two e2m1 codes a byte, an e4m3 scale per 16, the global scale
        assert isinstance(q, Nvfp4Linear) and torch.equal(q.packed, shipped[down + ".weight_packed"])
        assert torch.equal(q.scales.view(torch.uint8), shipped[down + ".weight_scale"].view(torch.uint8))
        return
    if kind == "W8A8":  # the integers, on the W8A16 kernels (Marlin 8-bit, per channel)
        assert isinstance(q, QuantLinear) and (q.bits, q.group_size) == (8, -1)
        return
    if kind == "MXFP4A16":  # the shipped bytes: two e2m1 codes a byte, a scale per 32
        assert isinstance(q, Mxfp4Linear) and torch.equal(
            q.blocks.flatten(1), shipped[down + ".weight_packed"]
        )
        assert torch.equal(q.scales, shipped[down + ".weight_scale"])
        return
    assert isinstance(q, Fp8Linear) and q.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(q.weight.view(torch.uint8), shipped[down + ".weight"].view(torch.uint8))


def _transformers(path: Path):
    """transformers on the checkpoint, its weights dequantized at load (compressed-tensors: decompressed, with no
    activation quantization left on)."""
    extra = {}
    qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") == "compressed-tensors":
        extra["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()


def test_compressed_tensors_presets_are_read_as_llm_compressor_writes_them(fp8):
    assert {p: detect(fp8[p]).scheme.summary() for p in ("FP8", "FP8_DYNAMIC", "FP8_BLOCK")} == {
        "FP8": "compressed-tensors FP8 e4m3 (one scale per tensor, static activations)",
        "FP8_DYNAMIC": "compressed-tensors FP8 e4m3 (one scale per output channel, dynamic activations)",
        "FP8_BLOCK": "compressed-tensors FP8 e4m3 (128×128 block scales, dynamic activations)",
    }
    assert detect(fp8["FP8_DYNAMIC"]).format == "compressed-tensors-fp8"
    mx = detect(fp8["MXFP4A16"])
    assert mx.format == "compressed-tensors-mxfp4" and mx.scheme.summary() == (
        "compressed-tensors MXFP4 (e2m1 weights, a power-of-two scale per 32, weight-only)"
    )
    out = CliRunner().invoke(main, ["inspect", str(fp8["MXFP4A16"]), "--backend", "torch"]).output
    assert (
        "q_proj: compressed-tensors MXFP4" in out and "keep them as they ship (4.25 bits a weight)" in out
    ), out
    assert detect(fp8["NVFP4A16"]).scheme.summary() == (
        "compressed-tensors NVFP4 (e2m1 weights, an e4m3 scale per 16 and a global one; activations in the "
        "checkpoint: none)"
    )
    w8 = detect(fp8["W8A8"])
    assert w8.scheme.summary() == (
        "compressed-tensors INT8 (symmetric, per channel; activations in the checkpoint: int8 per token (dynamic))"
    )
    assert set(w8.scheme.repack_targets()) == {"gptq", "marlin", "compressed-tensors"}  # 8-bit per channel
    out = CliRunner().invoke(main, ["inspect", str(fp8["FP8_BLOCK"])]).output
    assert "q_proj: F8_E4M3" in out and "granularity=block" in out


def _damaged(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    edit(tensors, config["quantization_config"])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


Q = "model.layers.0.self_attn.q_proj"
DAMAGES = {
    "a scale grid of the wrong shape": (
        lambda t, qc: t.update({f"{Q}.weight_scale_inv": torch.ones(3, 4)}),
        ModelFileError,
        [f"{Q}", "weight_scale_inv [3, 4]", "weight_scale_inv [3, 4]; [128, 128] needs [4, 2]"],
    ),
    "a block size that contradicts the scales": (
        lambda t, qc: qc.update(weight_block_size=[64, 64]),
        ModelFileError,
        ["weight_block_size [64, 64]", "[128, 256] needs [2, 4]"],
    ),
    "e5m2 weights where the config says e4m3": (
        lambda t, qc: t.update({f"{Q}.weight": t[f"{Q}.weight"].float().to(torch.float8_e5m2)}),
        ModelFileError,
        ["says e4m3 FP8", "stores F8_E5M2 weights"],
    ),
    "an FP8 weight without its scale": (
        lambda t, qc: t.pop(f"{Q}.weight_scale_inv"),
        ModelFileError,
        [f"'{Q}.weight' is F8_E4M3 but has no weight_scale_inv"],
    ),
    "an e5m2 checkpoint": (lambda t, qc: qc.update(fmt="e5m2"), UnsupportedFormatError, ["fmt 'e5m2'"]),
    "a malformed block size": (
        lambda t, qc: qc.update(weight_block_size=[128]),
        ModelFileError,
        ["weight_block_size [128] must be two positive integers"],
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_before_it_loads(damage, fp8, tmp_path):
    edit, error, words = DAMAGES[damage]
    bad = _damaged(fp8["b32x64"], tmp_path / "bad", edit)
    with pytest.raises(error) as e:
        detect(bad)
    for w in words:
        assert w in str(e.value), str(e.value)
    r = CliRunner().invoke(main, ["inspect", str(bad)])  # the CLI says the same, exit 2, no traceback
    assert r.exit_code == 2 and words[0] in r.output and "Traceback" not in r.output


def test_fp8_weights_without_a_config_are_named(fp8, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in fp8["b32x64"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    del config["quantization_config"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="is FP8-quantized but there is no quantization config"):
        detect(bad)


@pytest.fixture(scope="module")
def smollm2_fp8(smollm2_hf, tmp_path_factory) -> Path:
    """SmolLM2 in 128×128 blocks: 576 = 4.5 × 128, so its matrices end in partial blocks."""
    return write_fp8(smollm2_hf, tmp_path_factory.mktemp("smollm2-fp8") / "fp8", (128, 128))


def test_smollm2_fp8_answers_on_both_backends_with_the_same_tokens(smollm2_fp8):
    """The torch backend keeps the FP8 weights; llama.cpp serves the exact dequantization at Q8_0. Both answer, and
    their greedy tokens agree."""
    import quantserve

    replies = {}
    for backend in ("torch", "llamacpp"):
        llm = quantserve.load(str(smollm2_fp8), backend=backend, ctx_size=512, max_num_seqs=1)
        try:
            replies[backend] = greedy_chat(llm, 12)
        finally:
            llm.close()
    assert "Paris" in replies["torch"], replies
    assert replies["torch"] == replies["llamacpp"], replies


@pytest.mark.parametrize("kind", ["b32x64", "FP8_BLOCK", "MXFP4A16", "NVFP4A16"])
def test_dequantization_is_exactly_what_transformers_computes(kind, fp8, tmp_path):
    """What llama.cpp is given (and `convert` writes from): the weights transformers dequantizes the checkpoint
    to, bit for bit (NVFP4: compressed-tensors decompresses in bf16, ours in fp32 rounded to bf16 is theirs)."""
    from quantserve.quant.dequantize import dequantize_checkpoint

    ref = _transformers(fp8[kind]).state_dict()
    dense = load_file(dequantize_checkpoint(fp8[kind], tmp_path / "dense") / "model.safetensors")
    assert {n for n in dense if n.endswith("_proj.weight")} == {n for n in ref if n.endswith("_proj.weight")}
    for name, t in dense.items():
        bf16 = kind == "NVFP4A16" and name.endswith(
            "_proj.weight"
        )  # compressed-tensors' own NVFP4 arithmetic
        assert torch.equal(t.bfloat16().float() if bf16 else t, ref[name]), name


@pytest.mark.parametrize("kind", ["b32x64", "MXFP4A16"])
def test_convert_writes_a_gguf_from_fp8_and_mxfp4(kind, fp8, tmp_path):
    from quantserve.formats import read_gguf_info

    out = tmp_path / "tiny.gguf"
    args = ["convert", "--src", str(fp8[kind]), "--dst", str(out), "--quant", "q8_0", "--no-summary"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    meta = read_gguf_info(out).metadata
    assert meta["general.file_type"] == 7  # MOSTLY_Q8_0
    assert meta["general.name"] == kind.upper()  # the source's name, not the dense copy's
    assert not list(tmp_path.glob(".quantserve-dequant-*"))  # the dense copy beside it is gone


def test_a_compressed_fp8_layout_we_do_not_read_is_named(fp8, tmp_path):
    def edit(t, qc):
        qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor_group"

    bad = _damaged(fp8["FP8_DYNAMIC"], tmp_path / "bad", edit)
    with pytest.raises(UnsupportedFormatError, match="compressed-tensors FP8 weight strategy 'tensor_group'"):
        detect(bad)
    shape = _damaged(
        fp8["FP8_DYNAMIC"], tmp_path / "shape", lambda t, qc: t.update({f"{Q}.weight_scale": torch.ones(128)})
    )
    detect(shape)  # [N] for [N, 1]: one scale per row all the same
    short = _damaged(
        fp8["FP8_DYNAMIC"],
        tmp_path / "short",
        lambda t, qc: t.update({f"{Q}.weight_scale": torch.ones(64, 1)}),
    )
    with pytest.raises(
        ModelFileError,
        match=r"one scale per output channel but .* weight_scale \[64, 1\]; \[128, 128\] needs \[128, 1\]",
    ):
        detect(short)


def test_convert_quant_fp8_writes_what_compressed_tensors_writes(fp8, tiny_llama_hf, tmp_path):
    """`convert --quant fp8` equals compressed-tensors' own FP8_DYNAMIC output tensor for tensor (the same min/max
    scales, the same rounding), and transformers with compressed-tensors loads it: logits equal ours."""
    out = tmp_path / "fp8"
    r = CliRunner().invoke(
        main, ["convert", "--src", str(tiny_llama_hf), "--dst", str(out), "--quant", "fp8"]
    )
    assert r.exit_code == 0, r.output
    assert "FP8 weights, compressed-tensors float-quantized" in r.output
    assert (
        "quality: " in r.output and "torch (cpu" in r.output
    )  # the summary line, scored by the torch backend
    ours, theirs = load_file(out / "model.safetensors"), load_file(fp8["FP8_DYNAMIC"] / "model.safetensors")
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(
            ours[name].view(torch.uint8), t.view(torch.uint8)
        ), name
    config = [
        json.loads((d / "config.json").read_text())["quantization_config"] for d in (out, fp8["FP8_DYNAMIC"])
    ]
    assert config[0] == config[1]  # "ignore": ["lm_head"], though it is tied to the embeddings here
    model = load_model(detect(out), dtype=torch.float32, device=CPU)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = _transformers(out)(ids).logits[0]
        got = model.compute_logits(model(ids)[0])
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_an_fp8_checkpoint_is_not_repacked_to_an_integer_layout(fp8, tmp_path):
    r = CliRunner().invoke(
        main, ["convert", "--src", str(fp8["b128"]), "--dst", str(tmp_path / "x"), "--format", "gptq"]
    )
    assert r.exit_code == 2 and "cannot be written as gptq: its weights are floating point" in r.output, (
        r.output
    )
    assert not (tmp_path / "x").exists()


def test_an_int8_checkpoint_repacks_losslessly_to_gptq(fp8, tmp_path):
    """W8A8's integers are QuantizedWeight's: `convert --format gptq` writes the same integers, and the scales as
    GPTQ stores them, in fp16 (these fp32 ones rounded once; a bf16 model's fit fp16's range)."""
    from quantserve.formats.quant_read import open_quantized

    args = ["convert", "--src", str(fp8["W8A8"]), "--dst", str(tmp_path / "gptq"), "--format", "gptq"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    with open_quantized(fp8["W8A8"]) as a, open_quantized(tmp_path / "gptq") as b:
        assert a.linear_prefixes() == b.linear_prefixes() and len(a.linear_prefixes()) == 14
        for p in a.linear_prefixes():
            x, y = a.read_linear(p), b.read_linear(p)
            assert torch.equal(x.qweight, y.qweight) and torch.equal(x.scales.half(), y.scales), p


def test_fp8_writer_keeps_routers_dense_and_never_makes_nan():
    """Mixtral's router is `block_sparse_moe.gate` in its checkpoint; an fp16 row below fp16's range of scales (its
    amax / 448 underflows) keeps the smallest normal scale instead of dividing by zero."""
    from quantserve.converters.fp8 import _quantized, channel_fp8

    assert not _quantized("model.layers.0.block_sparse_moe.gate.weight", [8, 64])
    assert not _quantized("model.layers.0.mlp.gate.weight", [8, 64])
    assert _quantized("model.layers.0.block_sparse_moe.experts.1.w1.weight", [128, 64])
    src = torch.tensor([[1e-5, 0.0, -3e-6], [0.5, -0.25, 0.0]], dtype=torch.float16)
    q, scale = channel_fp8(src)
    w = q.float() * scale.float()
    assert not w.isnan().any() and scale.dtype == torch.float16
    assert ((w - src.float()).abs() <= 0.07 * src.float().abs()).all()  # within e4m3's rounding (2^-4)


def test_compressed_layouts_we_do_not_read_are_named(fp8, tmp_path):
    def asymmetric(t, qc):
        qc["config_groups"]["group_0"]["weights"]["symmetric"] = False

    def act_order(t, qc):
        qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"

    with pytest.raises(UnsupportedFormatError, match="asymmetric compressed-tensors FP8"):
        detect(_damaged(fp8["FP8_DYNAMIC"], tmp_path / "a", asymmetric))
    with pytest.raises(UnsupportedFormatError, match="int-quantized with actorder 'group'"):
        detect(_damaged(fp8["W8A8"], tmp_path / "b", act_order))


@pytest.mark.parametrize("preset", ["MXFP4A16", "NVFP4A16", "W8A8"])
def test_each_compressed_scheme_parses_its_own_config_as_compressed_tensors_hands_it_over(preset, fp8):
    """A scheme reached through CompressedTensors.parse parses the same config on its own to the same result."""
    from quantserve.formats.hf_config import find_quant_config

    spec = detect(fp8[preset])
    qc, where = find_quant_config(spec.config, spec.directory, {})
    assert type(spec.scheme).parse(qc, where) == spec.scheme
