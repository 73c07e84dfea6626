"""gpt-oss on the torch backend, against transformers on the same tiny random weights (4 layers, windowed and full
alternating with a window of 8, shorter than the prompts; sinks, attention and expert biases, YaRN): as a float
checkpoint and as released, with MXFP4 experts. transformers cannot load an MXFP4 checkpoint on this machine
(it needs accelerate), so its reference for that one is the float checkpoint its own MXFP4 dequantizer
(integrations/mxfp4.py) makes from the same blocks. The MXFP4 kernel is checked against dequantize-then-matmul."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import triton  # noqa: F401 - before any test sets TRITON_INTERPRET (see tests/kernels/test_w4a16_kernels.py)
from safetensors.torch import load_file, save_file

from quantserve.backends.torch.args import ModelArgs
from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.backends.torch.weights import load_model
from quantserve.errors import ConfigError, ModelFileError, UnsupportedFormatError
from quantserve.formats import detect, read_gguf_info
from quantserve.kernels import mxfp4
from tests.backends.torch.test_torch_engine import make_engine
from tests.backends.torch.test_torch_moe import LONG, PROMPTS, _together

CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)  # fmt: skip
CPU = torch.device("cpu")


def _copy_json(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst)


@pytest.fixture(scope="module")
def checkpoints(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    return make_checkpoints(smollm2_gguf, tmp_path_factory)


def make_checkpoints(smollm2_gguf: Path, tmp_path_factory) -> dict[str, Path]:
    """float: transformers' own save; mxfp4: its experts as MXFP4 blocks (released layout), and mxfp4-ref: those
    blocks dequantized by transformers, for transformers to run."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "router.weight", "router.bias")):
                p.normal_(0, 1.0)  # sinks that weigh, a router that prefers some experts
            else:
                p.normal_(0, 0.1)
    dense = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(dense)
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(dense)
    packed, ref = tmp_path_factory.mktemp("gpt-oss-mxfp4"), tmp_path_factory.mktemp("gpt-oss-mxfp4-ref")
    blocks, floats = {}, {}
    for name, t in load_file(dense / "model.safetensors").items():
        if name.endswith(
            ("experts.gate_up_proj", "experts.down_proj")
        ):  # [E, in, out] -> blocks of [E, out, in]
            b, s = mxfp4.quantize(t.transpose(1, 2))
            blocks |= {f"{name}_blocks": b, f"{name}_scales": s}
            floats[name] = convert_moe_packed_tensors(b, s, dtype=torch.float32)
        else:
            blocks[name] = floats[name] = t
    save_file(blocks, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, ref / "model.safetensors", metadata={"format": "pt"})
    for d in (packed, ref):
        _copy_json(dense, d)
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (packed / "config.json").write_text(json.dumps(config))
    return {"float": dense, "mxfp4": packed, "mxfp4-ref": ref}


def _reference(checkpoints, kind: str) -> transformers.PreTrainedModel:
    src = checkpoints["mxfp4-ref" if kind == "mxfp4" else kind]
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_prompt_logits_equal_transformers(kind, checkpoints):
    model = load_model(detect(checkpoints[kind]), dtype=torch.float32, device=CPU)
    ref = _reference(checkpoints, kind)
    ids = torch.tensor([LONG])  # 41 tokens: five windows of 8
    with torch.no_grad():
        want = ref(ids).logits[0]
        got = model.compute_logits(model(ids)[0])
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    sinks = model.model.layers[0].self_attn.sinks
    with torch.no_grad():  # the sinks are live: without them the logits move
        sinks.fill_(float("-inf"))
        assert (model.compute_logits(model(ids)[0]) - want).abs().max() > 1e-2 * want.abs().max()


def test_mxfp4_experts_load_as_they_ship(checkpoints):
    """The experts hold the checkpoint's own bytes (blocks and scales, 4.25 bits a weight), no float copy."""
    model = load_model(detect(checkpoints["mxfp4"]), dtype=torch.bfloat16, device=CPU)
    shipped = {n: t for n, t in load_file(checkpoints["mxfp4"] / "model.safetensors").items()
               if n.endswith(("_blocks", "_scales"))}  # fmt: skip
    held = {n: p for n, p in model.named_parameters() if n.endswith(("_blocks", "_scales"))}
    assert held.keys() == shipped.keys()
    assert all(torch.equal(held[n], shipped[n]) for n in held)
    loaded = sum(p.numel() * p.element_size() for p in held.values())
    assert loaded == sum(t.numel() for t in shipped.values())
    n_weights = sum(
        4 * 2 * 64 * 64 + 4 * 64 * 64 for _ in range(4)
    )  # gate|up and down of 4 experts, 4 layers
    assert loaded * 8 / n_weights == 4.25
    assert not any(
        "experts" in n and p.is_floating_point() and p.dim() == 3 for n, p in model.named_parameters()
    )
    assert detect(checkpoints["mxfp4"]).quant == {"dtype": "float32", "experts": "mxfp4"}


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_batched_chunked_cached_greedy_equals_transformers_alone(kind, checkpoints):
    src = checkpoints[kind]
    model = load_model(detect(src), dtype=torch.float32, device=CPU)
    ref = _reference(checkpoints, kind)
    want = []
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    engine, _ = make_engine((model, HFTokenizer.from_dir(src)), max_num_seqs=4, kv_tokens=1024, n_batch=8,
                            caching=True)  # fmt: skip
    assert _together(engine, PROMPTS, 10) == want  # chunks of 8 tokens mix prefill with decode
    assert _together(engine, [LONG], 10) == [want[1]] and engine.kv.hits == 32  # its first two blocks cached
    assert engine.kv.num_used == 0
    alone, _ = make_engine((model, HFTokenizer.from_dir(src)), max_num_seqs=1, kv_tokens=1024, n_batch=14)
    assert _together(alone, [LONG], 10) == [want[1]]  # 41 tokens in 3 chunks: 14, 14, 13


def test_preemption_recomputes_exactly(checkpoints):
    engine = preempted_equals_alone(checkpoints["mxfp4"])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def preempted_equals_alone(src: Path):
    """Three prompts batched in a 64-token pool (4 blocks of 16), so that one is preempted and recomputed, give
    each prompt's tokens alone; returns the batched engine for its ledger's counts."""
    model = load_model(detect(src), dtype=torch.float32, device=CPU)
    tok = HFTokenizer.from_dir(src)
    engine, _ = make_engine((model, tok), max_num_seqs=4, kv_tokens=64)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))[1]
    got = _together(engine, PROMPTS[:3], 24)
    assert preempted
    alone, _ = make_engine((model, tok), max_num_seqs=1, kv_tokens=512)
    assert got == [_together(alone, [p], 24)[0] for p in PROMPTS[:3]]
    return engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_mxfp4_kernel_equals_dequantize_then_matmul(dtype, m, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(m)
    blocks, scales = mxfp4.quantize(torch.randn(96, 160, generator=gen))
    x = torch.randn(m, 160, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    want = mxfp4.mxfp4_linear_ref(x.float(), blocks, scales, bias.float())
    got = mxfp4.mxfp4_linear(x, blocks, scales, bias)
    assert got.dtype == dtype
    # the output's own rounding to bf16: one unit in the last place, as Triton's interpreter truncates
    rounding = 0.0 if dtype == torch.float32 else 2.0**-7
    assert ((got.float() - want).abs() / (want.abs() * rounding + want.abs().max() * 1e-3)).max() < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_mxfp4_experts_equal_dequantize_then_matmul(dtype, tokens, monkeypatch):
    """Every expert in one launch (kernels/mxfp4.py's grouped GEMM): each slot's row is its token times its
    expert's dequantized weight, plus that expert's bias, times the slot's routed weight; rows of tokens (top_k)
    and rows of slots (top_k 0) both."""
    from quantserve.kernels.w4a16_moe import align_by_expert

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(tokens)
    n_exp, top_k, n, k = 5, 2, 96, 160
    blocks, scales = mxfp4.quantize(torch.randn(n_exp, n, k, generator=gen))
    bias = torch.randn(n_exp, n, generator=gen).to(dtype)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    chosen = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(tokens)])
    routed = torch.rand(tokens, top_k, generator=gen)
    aligned = align_by_expert(chosen, n_exp, 16)
    w = mxfp4.dequantize(blocks, scales)
    slot_x = x.float().repeat_interleave(top_k, 0)  # slot s is token s // top_k
    want = torch.stack(
        [slot_x[s] @ w[e].T + bias[e].float() for s, e in enumerate(chosen.flatten().tolist())]
    )
    rounding = 0.0 if dtype == torch.float32 else 2.0**-7
    for got, scale in (
        (mxfp4.mxfp4_moe_gemm(x, blocks, scales, bias, aligned, 16, top_k, tokens * top_k), None),
        (mxfp4.mxfp4_moe_gemm(slot_x.to(dtype), blocks, scales, bias, aligned, 16, 0, tokens * top_k, routed),
         routed.reshape(-1, 1)),
    ):  # fmt: skip
        ref = want if scale is None else want * scale
        assert got.dtype == dtype and got.shape == ref.shape
        assert ((got.float() - ref).abs() / (ref.abs() * rounding + ref.abs().max() * 1e-3)).max() < 1


def test_grouped_experts_give_transformers_logits(checkpoints, monkeypatch):
    """The model with its MXFP4 experts grouped (as on CUDA; here under Triton's interpreter) gives transformers'
    prompt logits, as the loop over experts does."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = load_model(detect(checkpoints["mxfp4"]), dtype=torch.float32, device=CPU)
    ids = torch.tensor([LONG])
    calls = []
    grouped = mxfp4.mxfp4_moe_gemm
    monkeypatch.setattr(mxfp4, "mxfp4_moe_gemm", lambda *a, **kw: calls.append(1) or grouped(*a, **kw))
    for layer in model.model.layers:
        layer.mlp.grouped = True
    with torch.no_grad():
        want = _reference(checkpoints, "mxfp4")(ids).logits[0]
        got = model.compute_logits(model(ids)[0])
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    assert len(calls) == 2 * len(model.model.layers)  # two launches a layer, whatever the experts chosen


def test_mxfp4_dequantize_matches_transformers_and_quantize_is_close():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(1))
    blocks, scales = mxfp4.quantize(w)
    got = mxfp4.dequantize(blocks, scales)
    assert torch.equal(got.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    # every block's largest value within 6 of its scale: the error is at most half a step of 2 at the top
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    assert ((got - w).abs() <= step).all()


def test_damaged_mxfp4_tensors_are_refused_before_loading(checkpoints, tmp_path):
    _copy_json(checkpoints["mxfp4"], tmp_path)
    tensors = load_file(checkpoints["mxfp4"] / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"] = tensors[
        "model.layers.1.mlp.experts.down_proj_scales"
    ][:, :, :1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks .*scales"):
        detect(tmp_path)


def test_config_errors_are_named(checkpoints):
    config = json.loads((checkpoints["mxfp4"] / "config.json").read_text())
    with pytest.raises(UnsupportedFormatError, match="layer_types"):
        ModelArgs.from_hf_config({**config, "layer_types": ["full_attention"] * 3})
    with pytest.raises(UnsupportedFormatError, match="multiples of 32"):
        ModelArgs.from_hf_config({**config, "intermediate_size": 48})
    with pytest.raises(UnsupportedFormatError, match="'gptq'"):
        ModelArgs.from_hf_config({**config, "quantization_config": {"quant_method": "gptq"}})
    from quantserve.backends.torch.tp_shard import expert_blocks, local_args

    # the experts split on whole 32-row blocks, the shares one block apart at most: 64 rows over 4 ranks cannot
    args = dataclasses.replace(
        ModelArgs.from_hf_config({**config, "num_key_value_heads": 4}), packed_experts=True
    )
    with pytest.raises(
        ConfigError, match=r"experts' 64 rows are fewer than 4 blocks of 32; use at most 2 ranks"
    ):
        local_args(args, 4)
    # the released 2880 rows (90 blocks) over 4 ranks: 23, 23, 22 and 22 blocks, end to end
    assert [expert_blocks(2880, r, 4) for r in range(4)] == [(0, 23), (23, 23), (46, 22), (68, 22)]


def test_the_quantizers_refuse_it_by_name(checkpoints, tmp_path):
    from quantserve.converters.calibration.quantize import quantize_checkpoint

    for method in ("rtn", "gptq"):
        with pytest.raises(
            UnsupportedFormatError, match=f"is gpt-oss, which `convert --quant {method}` does not"
        ):
            quantize_checkpoint(checkpoints["float"], tmp_path / "q", method)
    assert not list(tmp_path.iterdir())


def test_served_as_released_through_the_openai_client(checkpoints, tmp_path):
    """`quantserve run --backend torch` on the MXFP4 checkpoint: the client's answer is the engine's own greedy
    tokens (the tiny model's text means nothing)."""
    from tests.conftest import ask_openai, start_server

    srv = start_server(tmp_path, str(checkpoints["mxfp4"]), "--backend", "torch")
    r, _ = ask_openai(srv)
    model = load_model(detect(checkpoints["mxfp4"]), dtype=torch.float32, device=CPU)
    tok = HFTokenizer.from_dir(checkpoints["mxfp4"])
    engine, runner = make_engine((model, tok), max_num_seqs=1, kv_tokens=512)
    ids = runner.tokenize("The capital of France is", add_special=True, parse_special=False)
    text = b"".join(tok.token_bytes(t) for t in _together(engine, [ids], 8)[0]).decode("utf-8", "replace")
    assert r.choices[0].text == text
    assert "the experts as MXFP4, as they ship" in srv.log()


def test_eager_attention_in_slices_of_queries_is_the_same(monkeypatch):
    """attend's fp32 path (sinks, soft caps) runs a slice of the queries at a time to bound its scores' memory
    whatever the context: the slices give the one-pass result, masks of every shape."""
    from quantserve.backends.torch import attend as m

    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 8, 37, 16, generator=gen),
        torch.randn(2, 2, 50, 16, generator=gen),
        torch.randn(2, 2, 50, 16, generator=gen),
    )
    sinks = torch.randn(8, generator=gen)
    for mask in (
        None,
        torch.rand(2, 1, 37, 50, generator=gen) > 0.3,
        torch.rand(2, 1, 1, 50, generator=gen) > 0.3,
    ):
        for softcap, s in ((0.0, sinks), (3.0, sinks), (5.0, None)):
            whole = m.attend(q, k, v, mask, 0.25, softcap, s)
            monkeypatch.setattr(m, "_EAGER_SCORES", 2 * 8 * 50 * 4 * 5)  # 5 queries a slice
            assert torch.allclose(m.attend(q, k, v, mask, 0.25, softcap, s), whole, atol=1e-6)
            monkeypatch.undo()
