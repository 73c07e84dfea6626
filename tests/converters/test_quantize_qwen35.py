"""GPTQ, AWQ and RTN on Qwen3.5, dense and MoE: the calibration driver runs the Gated DeltaNet layers as transformers
does, quantizes attention, the MLP and every expert (the shared one too), and leaves the DeltaNet projections dense
unless asked (`--quantize-deltanet`: in_proj_qkv, in_proj_z and out_proj). The oracles are transformers' hidden
states on the source weights, and transformers on the written checkpoint dequantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantserve.backends.torch.args import ModelArgs
from quantserve.backends.torch.weights import load_model
from quantserve.converters.calibration.awq_block import awq_scale_block
from quantserve.converters.calibration.driver import SafetensorsReader, empty_block, load_layer, ropes
from quantserve.converters.calibration.layers import QuantizeOptions, block_linears, run_block
from quantserve.converters.calibration.quantize import quantize_checkpoint
from quantserve.converters.calibration.recipes import linear_shapes, sensitivity
from quantserve.errors import ConfigError
from quantserve.formats import detect
from quantserve.quant.dequantize import dequantize_checkpoint
from quantserve.quant.rtn import quantize_rtn
from tests.backends.torch.test_torch_moe import LONG
from tests.backends.torch.test_torch_qwen35 import _build, _reference

CPU = torch.device("cpu")
TOKENS = torch.randint(0, 49152, (4, 48), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def sources(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    return {kind: _build(kind, smollm2_gguf, tmp_path_factory) for kind in ("dense", "moe", "packed")}


def _args(src: Path) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads((src / "config.json").read_text()))


def _block(src: Path, layer: int, deltanet: bool = False):
    args = _args(src)
    block = empty_block(args, CPU, layer, deltanet=deltanet)
    load_layer(
        SafetensorsReader(detect(src).files, args.our_name), block.state_dict(), layer, args.norm_offset
    )
    return args, block


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_calibration_blocks_compute_transformers_layers(kind, sources):
    """Each layer's block, DeltaNet or gated attention, maps transformers' input of that layer to its output."""
    src = sources[kind]
    ref = _reference(src)
    with torch.no_grad():
        states = ref(
            TOKENS, output_hidden_states=True
        ).hidden_states  # each layer's input, then the final norm's
        for i in range(4):
            args, block = _block(src, i)
            assert block.linear == (i < 3)
            rope, _ = ropes(args, TOKENS.shape[1], CPU)
            got = run_block(block, states[i].clone(), rope, batch_size=2)
            got = ref.model.norm(got) if i == 3 else got
            want = states[i + 1]
            assert (got - want).abs().max() < 1e-4 * want.abs().max(), i


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("deltanet", [False, True], ids=["deltanet-dense", "deltanet-quantized"])
def test_awq_folding_keeps_deltanet_and_attention_blocks(kind, deltanet, sources, monkeypatch):
    """AWQ's scales folded into a DeltaNet block (its in_proj_a and in_proj_b columns too) and an attention block
    (the shared expert's gate and up, and its gate's columns) leave each computing what it did. The search is
    replaced by random scales, so that every fold moves something."""
    from quantserve.converters.calibration import awq_block, awq_moe

    gen = torch.Generator().manual_seed(1)

    def searcher(opt):
        return lambda x, ws, fn: torch.rand(x.shape[-1], generator=gen) + 0.5

    monkeypatch.setattr(awq_block, "scale_searcher", searcher)
    monkeypatch.setattr(awq_moe, "scale_searcher", searcher)
    hidden = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    for layer in (0, 3):
        args, block = _block(sources[kind], layer, deltanet)
        rope, _ = ropes(args, 16, CPU)
        with torch.no_grad():
            before = block(hidden, rope)
            state = {k: v.clone() for k, v in block.state_dict().items()}
            opt = QuantizeOptions("awq", 4, 32, False, False, deltanet=deltanet)
            inputs = awq_scale_block(block, hidden, rope, opt)
            after = block(hidden, rope)
        assert set(inputs) == set(block_linears(block))
        changed = {k for k, v in block.state_dict().items() if not torch.equal(v, state[k])}
        assert "post_attention_layernorm.weight" in changed
        assert ("input_layernorm.weight" in changed) == (layer == 3 or deltanet)
        if layer == 0:
            assert ("linear_attn.in_proj_a.weight" in changed) == deltanet
            assert "linear_attn.out_proj.weight" not in changed  # (no scale of its own)
        if kind == "moe":
            assert {"mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"} <= changed
        assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out |= {n: h.get_tensor(n) for n in h.keys()}  # noqa: SIM118 - not a dict
    return out


@pytest.mark.parametrize(
    ("kind", "method", "deltanet"),
    [("dense", "gptq", False), ("moe", "awq", False), ("dense", "awq", True), ("moe", "gptq", True),
     ("moe", "awq", True), ("dense", "awq-gptq", False), ("packed", "gptq", False)],
)  # fmt: skip
def test_a_quantized_qwen35_serves_as_its_dequantized_weights(kind, method, deltanet, sources, tmp_path):
    """The written checkpoint: attention, MLP and experts (shared one included) quantized, the DeltaNets dense
    byte for byte and named in GPTQModel's `dynamic` skip rules (or their three projections quantized with `deltanet`); the
    torch backend serves it with transformers' logits on it dequantized."""
    src = sources[kind]
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, method, bits=4, group_size=32, fmt="gptq", calib_tokens=TOKENS,
                        progress=False, deltanet=deltanet)  # fmt: skip
    got, source = _tensors(dst), _tensors(src)
    for i in (0, 3):
        expected = block_linears(_block(src, i, deltanet)[1])
        for name in expected:
            assert f"model.layers.{i}.{name}.qweight" in got, name
    assert ("model.layers.0.linear_attn.in_proj_qkv.qweight" in got) == deltanet
    assert ("model.layers.1.mlp.shared_expert.down_proj.qweight" in got) == (kind != "dense")
    assert not [
        n for n in got if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    ]  # (written apart)
    # (AWQ's scale for in_proj_qkv|z multiplies in_proj_a's and in_proj_b's columns: they stay dense, not as read)
    kept = (
        ("conv1d", "A_log", "dt_bias", "norm")
        + (("in_proj_a", "in_proj_b") if method != "awq" or not deltanet else ())
        + (() if deltanet else ("in_proj_qkv", "in_proj_z", "out_proj"))
    )
    for name in kept:
        for n in (k for k in source if k.startswith(f"model.layers.2.linear_attn.{name}")):
            assert torch.equal(got[n], source[n]), n
    rules = json.loads((dst / "config.json").read_text())["quantization_config"]["dynamic"]  # GPTQModel's
    for name in ("in_proj_b", "in_proj_ba"):  # (and vLLM's fused names)
        assert rf"-:model\.layers\.2\.linear_attn\.{name}$" in rules
    for name in ("in_proj_z", "in_proj_qkvz"):
        assert (rf"-:model\.layers\.2\.linear_attn\.{name}$" in rules) != deltanet
    if method.startswith("awq"):  # a folded scale leaves norm x the dense linears that read it as it was
        folds = [("input_layernorm", "linear_attn.in_proj_a"), ("input_layernorm", "linear_attn.in_proj_b")]
        if kind != "dense":
            folds += [
                ("post_attention_layernorm", "mlp.gate"),
                ("post_attention_layernorm", "mlp.shared_expert_gate"),
            ]
        for norm, linear in folds:
            was = (1 + source[f"model.layers.2.{norm}.weight"]) * source[f"model.layers.2.{linear}.weight"]
            now = (1 + got[f"model.layers.2.{norm}.weight"]) * got[f"model.layers.2.{linear}.weight"]
            assert torch.allclose(now, was, rtol=1e-5, atol=1e-7), (norm, linear)
        moved = not torch.equal(
            got["model.layers.2.input_layernorm.weight"], source["model.layers.2.input_layernorm.weight"]
        )
        assert moved == deltanet  # (only a quantized DeltaNet has a scale to fold there)

    model = load_model(detect(dst), dtype=torch.float32, device=CPU)
    assert (type(model.model.layers[0].linear_attn.in_proj_qkv) is not torch.nn.Linear) == deltanet
    ref = _reference(dequantize_checkpoint(dst, tmp_path / "dq", dtype="float32"))
    ids = torch.tensor([LONG])
    with torch.no_grad():
        want = ref(ids).logits
        assert (model.compute_logits(model(ids)) - want).abs().max() < 1e-3 * want.abs().max()


def test_gptq_is_closer_than_rtn_to_the_source(sources, tmp_path):
    """On a hybrid, calibration pays: GPTQ's 4-bit model (DeltaNets quantized too) is nearer the source's logits
    on calibration-like text than round-to-nearest's."""
    src = sources["dense"]
    errs = {}
    ids = TOKENS[:2]
    with torch.no_grad():
        dense = _reference(src)(ids).logits
        for method in ("rtn", "gptq"):
            quantize_checkpoint(src, tmp_path / method, method, bits=4, group_size=32, fmt="gptq",
                                calib_tokens=TOKENS, progress=False, deltanet=True)  # fmt: skip
            m = load_model(detect(tmp_path / method), dtype=torch.float32, device=CPU)
            errs[method] = float((m.compute_logits(m(ids)) - dense).pow(2).mean())
    assert errs["gptq"] < errs["rtn"], errs


@pytest.mark.slow  # a sensitivity pass over every linear
def test_a_bits_budget_scores_every_linear_of_a_hybrid_as_transformers_does(sources, tmp_path):
    """--bits-budget on Qwen3.5-MoE with its DeltaNets quantized: the sensitivity pass scores exactly the linears
    the quantizer rounds, and each score is the KL transformers gives with that one linear rounded (RTN) and the
    rest at full precision. The mixed checkpoint serves with transformers' logits on it dequantized."""
    src = sources["moe"]
    dst = tmp_path / "mixed"
    tokens = TOKENS[:2]
    quantize_checkpoint(src, dst, "rtn", bits=4, group_size=32, fmt="gptq", bits_budget=5.5,
                        calib_tokens=tokens, progress=False, deltanet=True)  # fmt: skip
    got, source = _tensors(dst), _tensors(src)
    shapes = linear_shapes(_args(src), deltanet=True)
    assert set(shapes) == {n.removesuffix(".qweight") for n in got if n.endswith(".qweight")}
    assert all(tuple(source[p + ".weight"].shape) == shape for p, shape in shapes.items())
    rules = json.loads((dst / "config.json").read_text())["quantization_config"]["dynamic"]
    raised = [r for r in rules if r.startswith("+:")]
    assert raised and all(rules[r]["bits"] == 8 for r in raised)  # the budget raised some, not all
    assert len(raised) < len(shapes)

    sens = sensitivity(src, tokens, 4, 32, deltanet=True, progress=False)
    assert set(sens.kl) == set(shapes) and sens.n_positions == tokens.numel()
    ref = _reference(src)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        want = torch.log_softmax(ref(tokens).logits.reshape(-1, ref.config.vocab_size), -1)
        for p in ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.2.linear_attn.out_proj",
                  "model.layers.3.self_attn.q_proj", "model.layers.1.mlp.shared_expert.down_proj"):  # fmt: skip
            w = params[p + ".weight"]
            kept = w.clone()
            w.copy_(quantize_rtn(kept, 4, 32, True, torch.float16, p).dequantize().t())
            lq = torch.log_softmax(ref(tokens).logits.reshape(-1, ref.config.vocab_size), -1)
            w.copy_(kept)
            kl = float((want.exp() * (want - lq)).sum(-1).mean())
            assert kl > 0 and abs(sens.kl[p] - kl) < 1e-2 * kl, (p, sens.kl[p], kl)

    model = load_model(detect(dst), dtype=torch.float32, device=CPU)
    dq = _reference(dequantize_checkpoint(dst, tmp_path / "dq", dtype="float32"))
    ids = torch.tensor([LONG])
    with torch.no_grad():
        want = dq(ids).logits
        assert (model.compute_logits(model(ids)) - want).abs().max() < 1e-3 * want.abs().max()


def test_what_a_hybrid_cannot_take_is_refused_before_any_work(sources, tmp_path):
    import transformers

    from tests.backends.torch.test_torch_model import CASES, TINY

    config_cls, extra = CASES["llama"]

    transformers.AutoModelForCausalLM.from_config(config_cls(**TINY, **extra)).save_pretrained(
        tmp_path / "llama"
    )
    with pytest.raises(ConfigError, match="--quantize-deltanet applies to models with Gated DeltaNet layers"):
        quantize_checkpoint(
            tmp_path / "llama",
            tmp_path / "b",
            "gptq",
            group_size=32,
            progress=False,
            deltanet=True,
            calib=str(tmp_path / "no-such-text.txt"),
        )  # (refused before the text is read)
    assert not (tmp_path / "b").exists()
