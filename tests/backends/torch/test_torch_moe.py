"""Qwen3-MoE on the torch backend, on a tiny random-weight checkpoint with SmolLM2's tokenizer: int4 at load against
transformers on the exactly dequantized weights, the routers left dense; greedy tokens of 4 requests of different
lengths batched under paged KV (with prefix caching) equal to transformers' greedy tokens for each alone; and a
router whose shape disagrees with num_experts is refused before anything loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import triton  # noqa: F401 - before any test sets TRITON_INTERPRET (see tests/kernels/test_w4a16_kernels.py)
from safetensors.torch import load_file, save_file

from quantserve.backends.torch.quant_linear import QuantLinear
from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.backends.torch.weights import load_model
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.errors import ModelFileError
from quantserve.formats import detect, read_gguf_info
from quantserve.quant.rtn import quantize_rtn
from tests.backends.torch.test_torch_engine import make_engine

CONFIG = dict(
    vocab_size=49152, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LONG = [1, *range(300, 340)]  # 41 tokens: two whole 16-token blocks to share
PROMPTS = [
    [1, 504, 3575, 282, 4649, 314],
    LONG,
    [1, 504, 3575, 282, 4649, 314, 7042, 30, 198, 504],
    [1, 40, 2],
]


def save_tiny_moe(d: Path, half_exact: bool = False) -> Path:
    """The tiny random Qwen3-MoE checkpoint (no tokenizer) in d; half_exact: every weight an fp16 value, so that a
    model loaded in fp16 quantizes the very weights that the fp32 reference does."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)  # a router that prefers some experts, so that routing matters
            else:
                p.normal_(0, 0.1)
            if half_exact:
                p.copy_(p.half().float())
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def moe_dir(smollm2_gguf, tmp_path_factory) -> Path:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    d = save_tiny_moe(tmp_path_factory.mktemp("qwen3moe"))
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(d)
    return d


def _dequantized_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with every decoder linear but the routers replaced by its RTN int4 weights, dequantized:
    what --quant int4 computes with (the same group choice as weights._quantize_in_place)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            group = next(g for g in (128, 64, 32) if w.shape[1] % g == 0)
            weights[name] = quantize_rtn(w.float(), bits=4, group_size=group).dequantize().T.contiguous()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def assert_logits_match(ours, ref, ids: list[int]) -> None:
    """Our prompt logits equal the reference's to 1e-3 of the logit scale."""
    t = torch.tensor([ids])
    with torch.no_grad():
        want = ref(t).logits
        got = ours.compute_logits(ours(t))
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()


def test_int4_at_load_equals_transformers_on_the_dequantized_weights(moe_dir, tmp_path):
    ours = load_model(detect(moe_dir), dtype=torch.float32, device=torch.device("cpu"), quant="int4")
    layer = ours.model.layers[0].mlp
    assert all(
        isinstance(getattr(e, p), QuantLinear) for e in layer.experts for p in ("gate_proj", "down_proj")
    )
    assert type(layer.gate) is torch.nn.Linear  # the router stays dense
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        _dequantized_copy(moe_dir, tmp_path / "dq")
    ).eval()
    assert_logits_match(ours, ref, PROMPTS[2])


def _together(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt added at once, then stepped until all are done: one batch."""
    outs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add(Sequence(f"p{i}", ids, sp, IncrementalDetokenizer(), max_total_tokens=512))
        outs[f"p{i}"] = []
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id].extend(out.token_ids)
    return [outs[f"p{i}"] for i in range(len(prompts))]


def test_batched_greedy_with_prefix_caching_equals_transformers_alone(moe_dir):
    model = load_model(detect(moe_dir), dtype=torch.float32, device=torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    want = []
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    engine, _ = make_engine((model, HFTokenizer.from_dir(moe_dir)), max_num_seqs=4, kv_tokens=1024, n_batch=8,
                            caching=True)  # fmt: skip
    assert _together(engine, PROMPTS, 10) == want  # 4 requests; chunks of 8 tokens mix prefill with decode
    assert _together(engine, [LONG], 10) == [want[1]] and engine.kv.hits == 32  # its first two blocks cached
    assert engine.kv.num_used == 0


def _experts_on_triton(model) -> None:
    """Every expert's linear prepared for the Triton W4A16 kernel (its interpreter here), as a GPU would have it."""
    for layer in model.model.layers:
        for expert in layer.mlp.experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                p = getattr(expert, name)
                cpu = torch.device("cpu")
                q = QuantLinear.from_marlin(p.marlin, None, dtype=torch.float32, device=cpu, name=p.name,
                                            kernel="triton_w4a16")  # fmt: skip
                setattr(expert, name, q)


def test_grouped_kernel_equals_transformers_batched_and_alone(moe_dir, tmp_path, monkeypatch):
    """int4 experts stacked for the grouped kernel (kernels/w4a16_moe.py, interpreted): the per-expert copies are
    gone, the logits are transformers' on the dequantized weights, and 4 requests batched under paged KV give
    transformers' greedy tokens for each alone."""
    from quantserve.backends.torch.fuse import fuse_projections

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ours = load_model(detect(moe_dir), dtype=torch.float32, device=torch.device("cpu"), quant="int4")
    _experts_on_triton(ours)
    fuse_projections(ours)
    assert all(x.mlp.grouped is not None and len(x.mlp.experts) == 0 for x in ours.model.layers)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        _dequantized_copy(moe_dir, tmp_path / "dq")
    ).eval()
    assert_logits_match(ours, ref, PROMPTS[2])
    with torch.no_grad():
        alone = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p) :]
                 for p in PROMPTS]  # fmt: skip
    engine, _ = make_engine((ours, HFTokenizer.from_dir(moe_dir)), max_num_seqs=4, kv_tokens=1024, n_batch=8,
                            caching=True)  # fmt: skip
    assert _together(engine, PROMPTS, 6) == [a.tolist() for a in alone]


def test_a_router_that_disagrees_with_num_experts_is_refused(moe_dir, tmp_path):
    bad = Path(shutil.copytree(moe_dir, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_experts": 8, "num_local_experts": 8}))
    with pytest.raises(ModelFileError, match=r"mlp\.(gate|experts)"):
        load_model(detect(bad), dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "awq-gptq"])
def test_quantserve_convert_writes_a_moe_checkpoint_the_torch_backend_serves(
    method, moe_dir, tmp_path, monkeypatch
):
    """`quantserve convert --quant gptq|rtn|awq|awq-gptq`: every expert's three linears quantized in the per-expert
    layout of GPTQModel (AutoAWQ for awq), the routers dense (AWQ's shared gate|up scale folded into the router's
    columns too); served by the torch backend (Marlin) with transformers' logits on the checkpoint dequantized
    exactly."""
    from safetensors import safe_open

    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.quant.dequantize import dequantize_checkpoint

    tokens = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
    out = tmp_path / method
    quantize_checkpoint(
        moe_dir, out, method, group_size=64, calib_tokens=tokens, progress=False
    )  # K=64 experts
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    for e in range(4):
        assert {
            f"model.layers.1.mlp.experts.{e}.{p}.qweight" for p in ("gate_proj", "up_proj", "down_proj")
        } <= names
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.0.mlp.gate.qweight" not in names
    ours = load_model(detect(out), dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours.model.layers[1].mlp.experts[3].down_proj, QuantLinear)
    ref_dir = dequantize_checkpoint(out, tmp_path / "dq", dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert_logits_match(ours, ref, PROMPTS[2])
    if method in ("gptq", "awq"):  # the same checkpoint on the grouped kernel, as a GPU runs it (interpreted)
        from quantserve.backends.torch.fuse import fuse_projections

        monkeypatch.setenv("TRITON_INTERPRET", "1")
        _experts_on_triton(ours)
        fuse_projections(ours)
        assert all(x.mlp.grouped is not None for x in ours.model.layers)
        assert_logits_match(ours, ref, PROMPTS[2])


def test_calibration_gives_every_expert_every_token(moe_dir):
    """However the router sends the calibration tokens, each expert's linears see all of them (so each gets a
    Hessian), and the block's output is still that of the routed experts alone."""
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.backends.torch.rope import RotaryEmbedding
    from quantserve.converters.calibration.driver import SafetensorsReader, empty_block, load_layer
    from quantserve.converters.calibration.layers import capture

    args = ModelArgs.from_hf_config(json.loads((moe_dir / "config.json").read_text()))
    block = empty_block(args, torch.device("cpu"))
    load_layer(SafetensorsReader(detect(moe_dir).files), block.state_dict(), 0)
    hidden = torch.randn(2, 16, 128)
    rope = RotaryEmbedding(args)(torch.arange(16), 15)
    seen: dict[str, int] = {}
    names = [f"mlp.experts.{e}.gate_proj" for e in range(4)]
    capture(block, hidden, rope, names, lambda n, x: seen.__setitem__(n, seen.get(n, 0) + x.shape[0]), 8)
    assert seen == dict.fromkeys(names, 32)
    with torch.no_grad():
        all_experts = block(hidden, rope)
        block.mlp.calibrate_all = False
        routed = block(hidden, rope)
    assert torch.allclose(all_experts, routed, atol=1e-5)


def test_awqs_scales_leave_a_moe_block_computing_what_it_did(moe_dir):
    """AWQ folds its scales into the norms and weights before rounding: the post-attention norm's into every
    expert's gate|up and the router's columns, each up's into its down. Folded, the block computes what it did,
    routing included (the router reads the rescaled norm)."""
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.backends.torch.rope import RotaryEmbedding
    from quantserve.converters.calibration.awq_block import awq_scale_block
    from quantserve.converters.calibration.driver import SafetensorsReader, empty_block, load_layer
    from quantserve.converters.calibration.layers import QuantizeOptions

    args = ModelArgs.from_hf_config(json.loads((moe_dir / "config.json").read_text()))
    block = empty_block(args, torch.device("cpu"))
    load_layer(SafetensorsReader(detect(moe_dir).files), block.state_dict(), 0)
    block.mlp.calibrate_all = False
    hidden = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(3))
    rope = RotaryEmbedding(args)(torch.arange(16), 15)
    with torch.no_grad():
        before = block(hidden, rope)
        router = block.mlp.gate.weight.clone()
        block.mlp.calibrate_all = True  # as the driver calibrates
        awq_scale_block(block, hidden, rope, QuantizeOptions("awq", 4, 64, False, False))
        block.mlp.calibrate_all = False
        after = block(hidden, rope)
    assert not torch.equal(router, block.mlp.gate.weight)  # a scale was folded into the router
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)


def assert_awq_folding_keeps_the_block(directory: Path, hidden_size: int) -> None:
    """AWQ's scales, searched on random activations and folded into the first layer's norms and weights (not yet
    rounded), leave that block computing what it did."""
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.backends.torch.rope import RotaryEmbedding
    from quantserve.converters.calibration.awq_block import awq_scale_block
    from quantserve.converters.calibration.driver import SafetensorsReader, empty_block, load_layer
    from quantserve.converters.calibration.layers import QuantizeOptions

    args = ModelArgs.from_hf_config(json.loads((directory / "config.json").read_text()))
    block = empty_block(args, torch.device("cpu"))
    load_layer(SafetensorsReader(detect(directory).files), block.state_dict(), 0, args.norm_offset)
    hidden = torch.randn(2, 16, hidden_size, generator=torch.Generator().manual_seed(3))
    rope = RotaryEmbedding(args)(torch.arange(16), 15)
    with torch.no_grad():
        before = block(hidden, rope)
        state = {k: v.clone() for k, v in block.state_dict().items()}
        awq_scale_block(block, hidden, rope, QuantizeOptions("awq", 4, 32, False, False))
        after = block(hidden, rope)
    changed = [k for k, v in block.state_dict().items() if not torch.equal(v, state[k])]
    assert any("norm" in k for k in changed) and any("down_proj" in k for k in changed), changed
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)


def test_a_bits_budget_scores_every_expert_and_leaves_the_routers_dense(moe_dir, tmp_path):
    """--bits-budget: the sensitivity pass rounds each linear alone, every expert's three included, and the
    recipe spends the budget on the most sensitive; the routers are never among them. The result serves with
    transformers' logits on it dequantized."""
    from safetensors import safe_open

    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.converters.calibration.recipes import linear_shapes
    from quantserve.quant.dequantize import dequantize_checkpoint

    args = load_model(detect(moe_dir), dtype=torch.float32, device=torch.device("cpu")).args
    names = linear_shapes(args)
    assert "model.layers.1.mlp.experts.3.down_proj" in names and not any(
        n.endswith("mlp.gate") for n in names
    )
    tokens = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "mixed"
    quantize_checkpoint(
        moe_dir, out, "rtn", group_size=64, bits_budget=6.0, calib_tokens=tokens, progress=False
    )
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config.get("dynamic")  # some linears got other bits than the base 4
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.gate.weight" in set(f.keys())
    ours = load_model(detect(out), dtype=torch.float32, device=torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        dequantize_checkpoint(out, tmp_path / "dq", dtype="float32"), dtype=torch.float32
    ).eval()
    assert_logits_match(ours, ref, PROMPTS[2])
