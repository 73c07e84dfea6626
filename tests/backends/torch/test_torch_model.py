"""The torch backend's model against transformers on the same weights: tiny random models of every architecture
and rope scaling, logits within 1e-3 of the logit scale, same greedy tokens, paged forward = whole-sequence forward."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import triton  # noqa: F401 - before any test sets TRITON_INTERPRET (see tests/kernels/test_w4a16_kernels.py)

from quantserve.backends.torch.model import KVCache, ModelArgs, Transformer
from quantserve.backends.torch.step import prepare_step
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-tied": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama3-rope": (
        transformers.LlamaConfig,
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
         "rope_theta": 500000.0},
    ),
    "linear-rope": (transformers.LlamaConfig, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "yarn-rope": (transformers.LlamaConfig, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 64}}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
    "qwen3-moe": (transformers.Qwen3MoeConfig, {"head_dim": 32, "moe_intermediate_size": 48, "num_experts": 4,
                                               "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "qwen3-moe-unnormalised": (transformers.Qwen3MoeConfig, {"head_dim": 32, "moe_intermediate_size": 48,
                                                            "num_experts": 4, "num_experts_per_tok": 2}),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": (transformers.Phi3Config, {"pad_token_id": 0}),
    # 80-token prompts run past the 64-token original context: transformers takes the long factors there
    "phi3-longrope": (transformers.Phi3Config, {
        "pad_token_id": 0, "original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0 + 0.3 * i for i in range(8)],
                         "short_factor": [1.0 + 0.05 * i for i in range(8)]}}),
    # Phi-4-mini: LongRoPE over the first half of each head (partial_rotary_factor), the rest not rotated
    "phi4-mini": (transformers.Phi3Config, {
        "pad_token_id": 0, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5,
        "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0 + 0.3 * i for i in range(4)],
                         "short_factor": [1.0 + 0.05 * i for i in range(4)]}}),
    "gemma2": (transformers.Gemma2Config, {"head_dim": 16, "sliding_window": 4, "attn_logit_softcapping": 1.0}),
    "gemma3": (transformers.Gemma3TextConfig, {"head_dim": 16, "sliding_window": 4,
                                               "layer_types": ["sliding_attention", "full_attention"]}),
}  # fmt: skip


def tiny_pair(case: str, tmp_path) -> tuple[torch.nn.Module, Transformer]:
    """A random transformers model and ours, loaded from the config.json and state dict it saves."""
    config_cls, extra = CASES[case]
    torch.manual_seed(0)
    config = config_cls(**TINY, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases too, so that a missed one shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
        for name, p in hf.named_parameters():  # a router that prefers some experts, so that routing matters
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0, 1.0)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ours = Transformer(ModelArgs.from_hf_config(cfg)).eval()
    # the saved file, not hf.state_dict(): transformers 5 fuses a MoE's experts in memory, one tensor per expert
    # on disk (the hub's layout, which is what quantserve loads)
    from safetensors.torch import load_file

    files, off = load_file(tmp_path / "model.safetensors"), ours.args.norm_offset  # Gemma's 1 + w, as at load
    saved = {ours.args.our_name(k): v + off * k.endswith("norm.weight") for k, v in files.items()}
    if "lm_head.weight" not in saved:
        saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    ours.load_state_dict(saved, strict=True)
    return hf, ours


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf, ours = tiny_pair(case, tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.compute_logits(ours(ids))
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-3 * scale, case


@pytest.mark.parametrize(
    "case", ["llama", "qwen3", "qwen3-moe", "mixtral", "phi3", "phi3-longrope", "phi4-mini"]
)
def test_greedy_tokens_match_transformers(case, tmp_path):
    hf, ours = tiny_pair(case, tmp_path)
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    want = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(ours.compute_logits(ours(torch.tensor([seq])))[0, -1].argmax()))
    assert seq[5:] == want


def attach_cache(model: Transformer, num_blocks: int, block_size: int) -> None:
    a = model.args
    for layer in model.model.layers:
        layer.self_attn.cache = KVCache(num_blocks * block_size, a.num_key_value_heads, a.head_dim,
                                        torch.float32, torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("paged_kernel", [False, True], ids=["gather", "kernel"])
@pytest.mark.parametrize(
    "case", ["llama", "qwen2", "qwen3", "qwen3-moe", "mixtral", "phi3", "phi4-mini", "gemma2", "gemma3"]
)
def test_paged_forward_equals_whole_sequence(case, paged_kernel, tmp_path, monkeypatch):
    """Three sequences in scattered blocks: one prefilled in two chunks (the second after 8 cached tokens, in the
    same step as two decodes), the others prefilled together in one padded call, then decoded together. The
    decodes attend through the gathered slots, or through the paged kernel (interpreted here) on block tables
    with the fused kernels of kernels/fused.py; the whole-sequence forward is PyTorch's ops."""
    if paged_kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, ours = tiny_pair(case, tmp_path)
    ours.use_fused_kernels(
        paged_kernel
    )  # with the kernel: the fused norm, rotary + KV write and silu kernels
    bs = 4
    attach_cache(ours, num_blocks=32, block_size=bs)
    g = torch.Generator().manual_seed(2)
    seqs = []
    for n, table in zip((13, 6, 9), ([5, 1, 7, 3], [2, 9], [11, 4, 8]), strict=True):
        s = Sequence(str(n), torch.randint(0, 128, (n,), generator=g).tolist(), SamplingParams(),
                     IncrementalDetokenizer(), 64)  # fmt: skip
        s.block_table = table
        seqs.append(s)
    with torch.no_grad():
        # step 1: seq 0 first chunk (8), seq 1 whole prompt minus last token (5), seq 2 all but its last (8)
        # step 2: seq 0 the rest (5 after 8 cached), seqs 1 and 2 one token each (the decode call)
        for plan in ([(seqs[0], 8), (seqs[1], 5), (seqs[2], 8)], [(seqs[0], 5), (seqs[1], 1), (seqs[2], 1)]):
            step = prepare_step(plan, bs, torch.device("cpu"), paged_kernel)
            hidden = ours(step.input_ids, step.positions, step)
            for s, n in plan:
                s.num_computed += n
        got = ours.compute_logits(hidden[step.logits_index])
        ours.use_fused_kernels(False)
        for j, s in enumerate(seqs):
            want = ours.compute_logits(ours(torch.tensor([s.tokens])))[0, -1]
            assert (got[j] - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("case", ["llama", "qwen2"])
@pytest.mark.parametrize("int4", [False, True], ids=["dense", "int4"])
def test_fused_projections_give_the_same_logits(case, int4, tmp_path):
    """q|k|v and gate|up fused after loading (qwen2: with q/k/v biases; int4: Marlin weights concatenated) give
    the unfused model's logits."""
    from quantserve.backends.torch.fuse import fuse_projections
    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.backends.torch.weights import _set_module, decoder_linears
    from quantserve.quant.rtn import quantize_rtn

    if int4:  # Marlin needs N % 64: wider heads than TINY's
        from quantserve.backends.torch.weights import _empty_model

        cfg = {**TINY, "hidden_size": 128, "intermediate_size": 192, "num_attention_heads": 2,
               "num_key_value_heads": 1, "architectures": [CASES[case][0].__name__.replace("Config", "ForCausalLM")]}  # fmt: skip
        torch.manual_seed(0)
        ours = _empty_model(ModelArgs.from_hf_config(cfg), torch.float32, torch.device("cpu"))
        with torch.no_grad():
            for p in ours.parameters():
                p.normal_(0, 0.1)
        for prefix in decoder_linears(ours):
            lin = ours.get_submodule(prefix)
            qw = quantize_rtn(lin.weight.detach(), bits=4, group_size=32, sym=True)
            bias = None if lin.bias is None else lin.bias.detach()
            _set_module(ours, prefix, QuantLinear.from_quantized(qw, bias, dtype=torch.float32,
                                                                 device=torch.device("cpu"), name=prefix))  # fmt: skip
    else:
        _, ours = tiny_pair(case, tmp_path)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours.compute_logits(ours(ids))
        assert fuse_projections(ours) == 2 * len(ours.model.layers)
        got = ours.compute_logits(ours(ids))
    layer = ours.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and not hasattr(layer.self_attn, "q_proj")
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_a_paged_forward_makes_no_host_sync_inside_the_layers(tmp_path, monkeypatch):
    """Every index the layers need is built once per step (prepare_step): inside the layers nothing may read a
    tensor's value back to the host (.item, .tolist, int(), bool(), .cpu(), nonzero), which on a GPU would stall
    the stream once per layer."""
    _, ours = tiny_pair("llama", tmp_path)
    attach_cache(ours, num_blocks=16, block_size=4)
    s1 = Sequence("a", list(range(1, 11)), SamplingParams(), IncrementalDetokenizer(), 64)
    s2 = Sequence("b", list(range(20, 23)), SamplingParams(), IncrementalDetokenizer(), 64)
    s1.block_table, s2.block_table = [3, 0, 7], [5]
    s2.num_computed = 2
    step = prepare_step([(s1, 10), (s2, 1)], 4, torch.device("cpu"))  # a prefill and a decode together
    syncs: list[str] = []
    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "cpu", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _name=name, _original=original, **kw):
            syncs.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counting)
    with torch.no_grad():
        ours(step.input_ids, step.positions, step, max_position=9)
    assert syncs == []


def test_smollm2_matches_transformers(smollm2_hf):
    """The real SmolLM2-135M (fp32, from our GGUF -> HF converter): logits and greedy tokens equal transformers'."""
    from quantserve.backends.torch.weights import load_model
    from quantserve.formats import detect

    ours = load_model(detect(smollm2_hf), dtype=torch.float32, device=torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, torch_dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 1780, 314,
                         260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]])  # fmt: skip
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.compute_logits(ours(ids))
        assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
        out = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1] :].tolist()
        seq = ids[0].tolist()
        for _ in range(10):
            seq.append(int(ours.compute_logits(ours(torch.tensor([seq])))[0, -1].argmax()))
    assert len(out) >= 5  # "The capital of France is Paris." then its end-of-turn, where generate stops
    assert seq[ids.shape[1] : ids.shape[1] + len(out)] == out


@pytest.mark.parametrize("case", ["phi3", "mistral", "mixtral"])
def test_a_windowed_model_is_exact_past_its_window(case, tmp_path):
    """Phi-3's, Mistral's and Mixtral's layers attend within `sliding_window` tokens (8 here): past the window the
    prompt logits are transformers', and the context served is the model's own, not the window
    (test_torch_families.py runs such models batched under paged KV)."""
    from quantserve.backends.torch.runner import TorchRunner
    from quantserve.backends.torch.weights import load_model
    from quantserve.core.settings import EngineSettings
    from quantserve.formats import detect

    config_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**TINY, **{**extra, "sliding_window": 8}))
    hf.eval().save_pretrained(tmp_path)
    ours = load_model(detect(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    assert [layer.self_attn.window for layer in ours.model.layers] == [8, 8]
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.compute_logits(ours(ids))
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
    assert TorchRunner(ours, None, EngineSettings(max_num_seqs=1), torch.device("cpu")).n_ctx == 256


def test_phi3_int4_at_load_equals_transformers_on_the_dequantized_weights(tmp_path):
    """--quant int4 quantizes Phi-3's fused q|k|v and gate|up as the single linears they are."""
    from safetensors.torch import load_file, save_file

    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.backends.torch.weights import load_model
    from quantserve.formats import detect
    from quantserve.quant.rtn import quantize_rtn

    config_cls, extra = CASES["phi3"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**TINY, **extra))
    hf.save_pretrained(tmp_path / "src")
    ours = load_model(detect(tmp_path / "src"), dtype=torch.float32, device=torch.device("cpu"), quant="int4")
    assert isinstance(ours.model.layers[0].self_attn.qkv_proj, QuantLinear)
    weights = load_file(tmp_path / "src/model.safetensors")
    for name, w in weights.items():  # what --quant int4 computes with (weights._quantize_in_place's groups)
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            group = next(g for g in (128, 64, 32) if w.shape[1] % g == 0)
            weights[name] = quantize_rtn(w.float(), bits=4, group_size=group).dequantize().T.contiguous()
    save_file(weights, tmp_path / "src/model.safetensors", metadata={"format": "pt"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    ids = torch.randint(0, TINY["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = ref(ids).logits, ours.compute_logits(ours(ids))
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()


@pytest.mark.parametrize("method", ["gptq", "rtn", "awq", "awq-gptq"])
def test_phi3s_fused_projections_quantize_as_the_linears_they_are(method, tmp_path):
    """`convert --quant gptq|rtn|awq(-gptq)` on Phi-3: fused linears as the checkpoint has them (GPTQModel's, AutoAWQ's
    layout), served as transformers dequantized (AWQ's folding is checked in test_awq_families)."""
    from safetensors import safe_open

    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.backends.torch.weights import load_model
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.formats import detect
    from quantserve.quant.dequantize import dequantize_checkpoint

    config_cls, extra = CASES["phi3"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config_cls(**TINY, **extra)).save_pretrained(
        tmp_path / "src"
    )
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    out = tmp_path / method
    quantize_checkpoint(tmp_path / "src", out, method, group_size=32, calib_tokens=tokens, progress=False)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {
            "model.layers.1.self_attn.qkv_proj.qweight",
            "model.layers.1.mlp.gate_up_proj.qweight",
        } <= set(f.keys())
    ours = load_model(detect(out), dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours.model.layers[0].self_attn.qkv_proj, QuantLinear)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        dequantize_checkpoint(out, tmp_path / "dq", dtype="float32"), dtype=torch.float32
    ).eval()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(ids).logits, ours.compute_logits(ours(ids))
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
    if method == "rtn":  # --bits-budget's sensitivity pass scores the fused linears too, and raises some
        quantize_checkpoint(tmp_path / "src", tmp_path / "mixed", method, group_size=32, bits_budget=7.0,
                            calib_tokens=tokens, progress=False)  # fmt: skip
        dynamic = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"][
            "dynamic"
        ]
        assert any("qkv_proj" in rule or "gate_up_proj" in rule for rule in dynamic), dynamic


def test_longrope_needs_its_original_context():
    from quantserve.errors import UnsupportedFormatError

    cfg = {**TINY, "architectures": ["Phi3ForCausalLM"],
           "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}}  # fmt: skip
    with pytest.raises(UnsupportedFormatError, match="no original_max_position_embeddings"):
        ModelArgs.from_hf_config(cfg)
    su = ModelArgs.from_hf_config({**cfg, "original_max_position_embeddings": 64,
                                   "rope_scaling": {**cfg["rope_scaling"], "rope_type": "su"}})  # fmt: skip
    assert dict(su.rope_scaling)["rope_type"] == "longrope"  # Phi3Config renames its older configs' types too


def test_mixtral_loads_and_quantizes_under_its_own_names(tmp_path):
    """Mixtral's checkpoint names (`block_sparse_moe.experts.E.w1/w2/w3`) load into the shared MoE modules, and
    GPTQ writes its experts back under those names (as GPTQModel does for Mixtral), the router dense: the torch
    backend serves the result with transformers' logits on it dequantized exactly."""
    from safetensors import safe_open

    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.backends.torch.weights import load_model
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.formats import detect
    from quantserve.quant.dequantize import dequantize_checkpoint

    hf, ours = tiny_pair("mixtral", tmp_path / "src")
    loaded = load_model(detect(tmp_path / "src"), dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.randint(0, TINY["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids).logits
        got = loaded.compute_logits(loaded(ids))
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
    config_cls, extra = CASES["mixtral"]  # k/v and experts 64 and 128 wide: Marlin tiles are 64 columns
    torch.manual_seed(0)
    sizes = {**TINY, "intermediate_size": 128, "num_key_value_heads": 4}
    wide = transformers.AutoModelForCausalLM.from_config(config_cls(**sizes, **extra))
    wide.save_pretrained(tmp_path / "wide")
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_checkpoint(
        tmp_path / "wide", tmp_path / "q", "gptq", group_size=32, calib_tokens=tokens, progress=False
    )
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.1.block_sparse_moe.experts.3.{w}.qweight" for w in ("w1", "w2", "w3")} <= names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)
    ours = load_model(detect(tmp_path / "q"), dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours.model.layers[1].mlp.experts[3].up_proj, QuantLinear)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        dequantize_checkpoint(tmp_path / "q", tmp_path / "dq", dtype="float32"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want, got = ref(ids).logits, ours.compute_logits(ours(ids))
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()


def test_a_load_does_not_import_torch_dynamo(tiny_llama_hf):
    """The model is built on the meta device, where nn.Embedding's random init and torch.arange go through
    torch's Python references, which import torch._dynamo: 1.4-1.8 s of every torch load (a server's start, each
    tensor-parallel rank's). Neither is reached any more; a fresh process shows it."""
    import subprocess
    import sys

    code = (
        "import asyncio, sys, quantserve\n"
        f"llm = quantserve.load({str(tiny_llama_hf)!r}, backend='torch', threads=1)\n"
        "async def two(): return [t async for t in llm.complete('Hello', max_tokens=2, temperature=0)]\n"
        "asyncio.run(two())\n"
        "llm.close()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "False"
