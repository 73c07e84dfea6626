"""Qwen3.5 (dense) on the torch backend, against transformers on the same tiny random weights: three Gated DeltaNet
layers and one gated full-attention layer (partial rotary, q/k norms, (1 + w) norms), with SmolLM2's tokenizer.
The engine gives each running sequence a recurrent-state slot beside its KV blocks; the checks are transformers'
logits, its greedy tokens for sequences batched, chunked and preempted, and a ledger that gets every slot back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import triton  # noqa: F401 - before any test sets TRITON_INTERPRET (see tests/kernels/test_w4a16_kernels.py)

from quantserve.backends.torch.args import ModelArgs
from quantserve.backends.torch.deltanet import delta_rule_chunked, delta_rule_recurrent
from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.backends.torch.weights import load_model
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats import detect, read_gguf_info
from tests.backends.torch.test_torch_engine import make_engine
from tests.backends.torch.test_torch_moe import LONG, PROMPTS, _together

CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
CPU = torch.device("cpu")


VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)  # fmt: skip
MOE = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def checkpoints(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    return {
        kind: _build(kind, smollm2_gguf, tmp_path_factory) for kind in ("dense", "moe", "released", "packed")
    }


@pytest.fixture(scope="module")
def checkpoint(checkpoints) -> Path:
    return checkpoints["dense"]


def _build(kind: str, smollm2_gguf: Path, tmp_path_factory) -> Path:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    torch.manual_seed(0)
    if kind in ("moe", "packed"):
        config = {k: v for k, v in CONFIG.items() if k != "intermediate_size"} | MOE
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**config))
    elif kind == "released":  # as Qwen3.5 ships: the text model behind a vision tower
        text = {k: v for k, v in CONFIG.items() if k != "tie_word_embeddings"}
        model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
            text_config=text, vision_config=VISION, tie_word_embeddings=False))  # fmt: skip
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)  # scales by w
            elif name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.3)  # scales by 1 + w
            elif name.endswith("A_log"):
                p.uniform_(-1, 1)
            elif name.endswith("dt_bias"):
                p.uniform_(0, 1)
            elif name.endswith(".mlp.gate.weight"):
                p.normal_(0, 1.0)  # a router that prefers some experts
            else:
                p.normal_(0, 0.1)
    if (
        kind == "released"
    ):  # bf16, but A_log and the gated norms in fp32, as the released checkpoints store them
        model.to(torch.bfloat16)
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "linear_attn.norm.weight")):
                p.data = p.data.float()
    d = tmp_path_factory.mktemp(f"qwen35-{kind}")
    model.save_pretrained(d)
    if (
        kind == "packed"
    ):  # transformers 5's own layout, as the released MoE checkpoints ship: each layer's experts
        # in mlp.experts.gate_up_proj [E, 2 I, H] and down_proj [E, H, I] (save_pretrained writes them apart)
        from safetensors.torch import save_file

        (d / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, d / "model.safetensors",
                  metadata={"format": "pt"})  # fmt: skip
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(d)
    return d


def _reference(src: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def test_the_chunked_delta_rule_equals_the_recurrent_one_and_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 150, 3, 16, 8  # three chunks of 64, the last one short
    q, k = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    g, beta = -2 * torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, generator=gen)
    s0 = 0.1 * torch.randn(b, h, dk, dv, generator=gen)
    qn = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o1, s1 = delta_rule_recurrent(qn, kn, v, g, beta, s0)
    o2, s2 = delta_rule_chunked(qn, kn, v, g, beta, s0)
    o3, s3 = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)  # fmt: skip
    for o, s in ((o2, s2), (o3, s3)):
        assert (o - o1).abs().max() < 1e-4 * o1.abs().max() and (s - s1).abs().max() < 1e-4 * s1.abs().max()


@pytest.mark.parametrize("kind", ["dense", "moe", "released", "packed"])
def test_prompt_logits_equal_transformers(kind, checkpoints):
    checkpoint = checkpoints[kind]
    model = load_model(detect(checkpoint), dtype=torch.float32, device=CPU)
    ref = _reference(checkpoint)
    ids = torch.tensor([LONG, list(range(400, 441))])  # and whole chunks: 150 tokens below
    long = torch.tensor([[1, *range(500, 649)]])
    with torch.no_grad():
        for x in (ids, long):
            want = ref(x).logits
            assert (model.compute_logits(model(x)) - want).abs().max() < 1e-3 * want.abs().max()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batched_chunked_greedy_equals_transformers_alone(kind, checkpoints):
    checkpoint = checkpoints[kind]
    model = load_model(detect(checkpoint), dtype=torch.float32, device=CPU)
    ref = _reference(checkpoint)
    want = []
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    tok = HFTokenizer.from_dir(checkpoint)
    engine, runner = make_engine((model, tok), max_num_seqs=4, kv_tokens=1024, n_batch=8, caching=True)
    assert (
        runner.kv_spec.state_slots == 4 and not runner.kv_spec.prefix_cache
    )  # caching asked for, and refused
    assert _together(engine, PROMPTS, 10) == want  # chunks of 8 tokens mix prefill with decode
    assert _together(engine, [LONG], 10) == [want[1]] and engine.kv.hits == 0
    assert engine.kv.num_used == 0 and sorted(engine.kv.free_states) == [0, 1, 2, 3]
    alone, _ = make_engine((model, tok), max_num_seqs=1, kv_tokens=1024, n_batch=14)
    assert _together(alone, [LONG], 10) == [want[1]]  # 41 tokens in 3 chunks: 14, 14, 13, the state carried


def rule_inputs(
    n: int, n_k: int, n_v: int, d_k: int, d_v: int, gen, decay: float = 2.0
) -> tuple[torch.Tensor, ...]:
    """The delta rule's fp32 inputs for n rows (tokens, or sequences one token each), as the layer hands them over:
    q, k [n, H_k, d_k] normalised (q scaled), v [n, H_v, d_v], g in (-decay, 0] and beta in [0, 1) [n, H_v]."""
    q = torch.nn.functional.normalize(torch.randn(n, n_k, d_k, generator=gen), dim=-1) * d_k**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, n_k, d_k, generator=gen), dim=-1)
    v = torch.randn(n, n_v, d_v, generator=gen)
    return q, k, v, -decay * torch.rand(n, n_v, generator=gen), torch.rand(n, n_v, generator=gen)


@pytest.mark.parametrize(("n_k", "n_v", "d_k", "d_v"), [(2, 4, 16, 16), (1, 3, 24, 40)])
def test_the_triton_decode_step_equals_the_recurrent_rule(n_k, n_v, d_k, d_v, monkeypatch):
    """kernels/deltanet.py under the interpreter: each decoding sequence's state updated in its own slot (slots out
    of order, others untouched; key heads shared by groups of value heads; sizes that are not powers of two)."""
    from quantserve.kernels.deltanet import decode_step

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(d_v)
    b, slots = 3, torch.tensor([4, 0, 2])
    q, k, v, g, beta = rule_inputs(b, n_k, n_v, d_k, d_v, gen)
    state = torch.randn(5, n_v, d_k, d_v, generator=gen)
    before = state.clone()
    rep = n_v // n_k
    want, new = delta_rule_recurrent(q[:, None].repeat_interleave(rep, 2), k[:, None].repeat_interleave(rep, 2),
                                     v[:, None], g[:, None], beta[:, None], before[slots])  # fmt: skip
    got = decode_step(q, k, v, g, beta, state, slots)
    assert (got - want[:, 0]).abs().max() < 1e-5 * want.abs().max()
    assert (state[slots] - new).abs().max() < 1e-5 * new.abs().max()
    assert torch.equal(state[[1, 3]], before[[1, 3]])


@pytest.mark.parametrize(
    ("n_k", "n_v", "d_k", "d_v", "t"), [(2, 4, 16, 16, 37), (1, 3, 24, 40, 16), (2, 2, 32, 32, 5)]
)
def test_the_triton_prefill_equals_the_chunked_rule(n_k, n_v, d_k, d_v, t, monkeypatch):
    """kernels/deltanet.py's prefill under the interpreter: one sequence's tokens in chunks of 16 (the last one
    short, or the only one), from the state in its slot, which is updated in place; the other slots untouched."""
    from quantserve.kernels.deltanet import prefill

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(t)
    q, k, v, g, beta = rule_inputs(t, n_k, n_v, d_k, d_v, gen)
    state = torch.randn(3, n_v, d_k, d_v, generator=gen)
    before = state.clone()
    rep = n_v // n_k
    want, new = delta_rule_chunked(q[None].repeat_interleave(rep, 2), k[None].repeat_interleave(rep, 2), v[None],
                                   g[None], beta[None], before[1:2])  # fmt: skip
    got = prefill(q, k, v, g, beta, state, 1)
    assert (got - want[0]).abs().max() < 1e-5 * want.abs().max()
    assert (state[1] - new[0]).abs().max() < 1e-5 * new.abs().max()
    assert torch.equal(state[[0, 2]], before[[0, 2]])


def test_decoding_through_the_triton_kernels_gives_transformers_tokens(checkpoints, monkeypatch):
    """The engine as it runs on CUDA (the DeltaNet prefill and decode kernels, paged attention and the fused
    kernels), here under the interpreter: 4 prompts batched, the greedy tokens equal transformers'."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    checkpoint = checkpoints["moe"]
    model = load_model(detect(checkpoint), dtype=torch.float32, device=CPU)
    ref = _reference(checkpoint)
    want = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
            for p in PROMPTS]  # fmt: skip
    engine, runner = make_engine((model, HFTokenizer.from_dir(checkpoint)), max_num_seqs=4, kv_tokens=1024,
                                 n_batch=64)  # fmt: skip
    assert runner.paged_kernel and model.model.layers[0].linear_attn.triton_ops
    from quantserve.backends.torch import deltanet

    calls, prefills = [], []
    step, prefill = deltanet.kernel.decode_step, deltanet.kernel.prefill
    monkeypatch.setattr(deltanet.kernel, "decode_step", lambda *a: calls.append(a[0].shape[0]) or step(*a))
    monkeypatch.setattr(deltanet.kernel, "prefill", lambda *a: prefills.append(a[0].shape[0]) or prefill(*a))
    assert _together(engine, PROMPTS, 6) == want
    assert max(calls) == 4  # the four sequences decoded together, through the kernel
    assert sorted(prefills) == sorted(len(p) for p in PROMPTS for _ in range(3))  # each prompt, in 3 layers


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_preemption_recomputes_the_state_exactly(kind, checkpoints):
    from tests.backends.torch.test_torch_gpt_oss import preempted_equals_alone

    engine = preempted_equals_alone(checkpoints[kind])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and len(engine.kv.free_states) == 4


def test_two_hundred_cancelled_requests_leave_the_ledger_as_it_was(checkpoint):
    model = load_model(detect(checkpoint), dtype=torch.float32, device=CPU)
    engine, _ = make_engine(
        (model, HFTokenizer.from_dir(checkpoint)), max_num_seqs=4, kv_tokens=1024, n_batch=16
    )
    before = (engine.kv.num_free_blocks, sorted(engine.kv.free_states))
    for i in range(200):
        sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        engine.add(Sequence(f"c{i}", PROMPTS[i % 4], sp, IncrementalDetokenizer(), max_total_tokens=512))
        if i % 7 == 0:
            engine.step()  # some are admitted and running (some mid-prefill) when they are cancelled
        if i % 3 == 0:
            engine.abort(f"c{i}")
    for i in range(200):
        engine.abort(f"c{i}")
    assert not engine.has_work()
    assert (engine.kv.num_free_blocks, sorted(engine.kv.free_states)) == before
    assert _together(engine, [PROMPTS[0]], 4)  # and it still serves


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_int4_at_load_keeps_the_deltanets_dense(kind, checkpoints):
    from torch import nn

    model = load_model(detect(checkpoints[kind]), dtype=torch.float32, device=CPU, quant="int4")
    layer0, layer3 = model.model.layers[0], model.model.layers[3]
    assert (
        type(layer0.linear_attn.in_proj_qkv) is nn.Linear and type(layer3.self_attn.q_proj) is not nn.Linear
    )
    mlp = layer0.mlp.shared_expert if kind == "moe" else layer0.mlp
    assert type(mlp.gate_proj) is not nn.Linear
    if kind == "moe":  # the router and the shared expert's gate stay dense
        assert type(layer0.mlp.gate) is nn.Linear and type(layer0.mlp.shared_expert_gate) is nn.Linear
    with torch.no_grad():
        assert model.compute_logits(model(torch.tensor([LONG]))).isfinite().all()


def test_bad_input_is_named_and_nothing_half_loads(checkpoint, tmp_path):
    import json
    import shutil

    config = json.loads((checkpoint / "config.json").read_text())
    with pytest.raises(UnsupportedFormatError, match="layer_types"):
        ModelArgs.from_hf_config({**config, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    src = Path(
        shutil.copytree(checkpoint, tmp_path / "m")
    )  # layer 0 said full: its attention tensors are absent
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    (src / "config.json").write_text(json.dumps({**config, "layer_types": types}))
    with pytest.raises(ModelFileError, match=r"lacks \d+ tensors .*model\.layers\.0\.self_attn"):
        load_model(detect(src), dtype=torch.float32, device=CPU)
    from quantserve.backends.torch.tp_shard import local_args
    from quantserve.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"1 DeltaNet key heads \(linear_num_key_heads\) do not split evenly over 2"
    ):
        local_args(ModelArgs.from_hf_config({**config, "linear_num_key_heads": 1}), 2)


def test_the_runner_logs_the_state_and_why_prefix_caching_is_off(checkpoint, caplog):
    """(The server's log: `quantserve run --backend torch` prints what the TorchRunner logs.)"""
    import logging

    model = load_model(detect(checkpoint), dtype=torch.float32, device=CPU)
    with caplog.at_level(logging.INFO, logger="quantserve.torch"):
        make_engine((model, HFTokenizer.from_dir(checkpoint)), max_num_seqs=4, kv_tokens=256)
    assert "recurrent state: 4 slots" in caplog.text and "prefix caching is off for this model" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_paged_deltanet_continues_each_slot_exactly(dtype):
    """Two sequences in slots 2 and 0: prefill chunks of different lengths, then decode steps gathered by slot,
    give the whole-sequence outputs (bit for bit in bf16: the same conv and rule, in the same dtypes)."""
    from types import SimpleNamespace

    from quantserve.backends.torch.deltanet import GatedDeltaNet, RecurrentState

    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 2, 4, 16, 16, 4, 1e-6).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        x = torch.randn(2, 30, 64).to(dtype)
        whole = layer(x)
        layer.state = RecurrentState.empty(4, layer, dtype, CPU)
        got, pos = ([], []), [0, 0]
        for n0, n1 in [(13, 7), (10, 9)] + [(1, 1)] * 7:
            flat = torch.cat((x[0, pos[0] : pos[0] + n0], x[1, pos[1] : pos[1] + n1]))
            step = SimpleNamespace(recurrent=((0, n0, 2, pos[0] == 0), (n0, n1, 0, pos[1] == 0)))
            out = layer(flat, step)
            got[0].append(out[:n0])
            got[1].append(out[n0:])
            pos = [pos[0] + n0, pos[1] + n1]
    tol = 1e-5 if dtype == torch.float32 else 0.0
    for i in range(2):
        assert (torch.cat(got[i]) - whole[i, : pos[i]]).abs().max() <= tol


def test_a_quantized_deltanet_is_refused_before_anything_loads(checkpoint, tmp_path):
    """A GPTQ checkpoint that quantizes a DeltaNet's in_proj_b (one output per value head: the kernels run it in
    full precision only; its in_proj_qkv, in_proj_z and out_proj may be quantized,
    tests/converters/test_quantize_qwen35.py)."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = Path(shutil.copytree(checkpoint, tmp_path / "m"))
    tensors = load_file(src / "model.safetensors")
    prefix = "model.layers.0.linear_attn.in_proj_b"
    del tensors[prefix + ".weight"]
    k, n, group = 64, 4, 32
    tensors |= {
        f"{prefix}.qweight": np.zeros((k * 8 // 32, n), np.int32),
        f"{prefix}.qzeros": np.full((k // group, n * 8 // 32), 0x7F7F7F7F, np.int32),
        f"{prefix}.scales": np.ones((k // group, n), np.float16),
        f"{prefix}.g_idx": (np.arange(k) // group).astype(np.int32),
    }
    save_file(tensors, src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": group, "desc_act": False,
                                     "sym": True}  # fmt: skip
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedFormatError, match=r"quantizes a Gated DeltaNet's in_proj_b \(model\.layers\.0"
    ):
        load_model(detect(src), dtype=torch.float32, device=CPU)
