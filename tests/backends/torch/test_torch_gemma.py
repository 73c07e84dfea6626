"""Gemma 2 and Gemma 3 (text) on the torch backend, on tiny random-weight checkpoints with SmolLM2's tokenizer and
windows (6 tokens) shorter than every prompt but the last: prompt logits against transformers, dense and int4 at
load (against transformers on the dequantized weights); greedy tokens of 4 requests of different lengths batched
under paged KV, in prefill chunks of 8 tokens, with prefix caching, equal to transformers' greedy tokens for each
alone; and a config whose layer types do not fit its layers is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.backends.torch.weights import load_model
from quantserve.errors import UnsupportedFormatError
from quantserve.formats import detect, read_gguf_info
from tests.backends.torch.test_torch_engine import make_engine
from tests.backends.torch.test_torch_moe import (
    LONG,
    PROMPTS,
    _dequantized_copy,
    _together,
    assert_awq_folding_keeps_the_block,
    assert_logits_match,
)

SIZES = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, sliding_window=6, max_position_embeddings=512, query_pre_attn_scalar=24,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
FAMILIES = {
    # Gemma 2: alternate windowed and global layers, tanh caps on the attention and final logits
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config, {}),
    # Gemma 3: q/k norms, no caps, a local rope base (10k) for the windowed layers and a scaled global one
    "gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        {
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma_dir(request, smollm2_gguf, tmp_path_factory) -> Path:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    model_cls, config_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SIZES, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if name.endswith("norm.weight") else 0.1)  # (1 + w) norms: w around 0
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(d)
    return d


def test_dense_and_int4_equal_transformers(gemma_dir, tmp_path):
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    ours = load_model(detect(gemma_dir), dtype=torch.float32, device=torch.device("cpu"))
    assert [layer.self_attn.window for layer in ours.model.layers] == [
        6 if t == "sliding_attention" else 0 for t in ref.config.layer_types
    ]
    assert_logits_match(ours, ref, LONG)  # 41 tokens: every window is full
    ours = load_model(detect(gemma_dir), dtype=torch.float32, device=torch.device("cpu"), quant="int4")
    dq = transformers.AutoModelForCausalLM.from_pretrained(
        _dequantized_copy(gemma_dir, tmp_path / "dq")
    ).eval()
    assert_logits_match(ours, dq, LONG)


def test_batched_greedy_with_prefix_caching_equals_transformers_alone(gemma_dir):
    model = load_model(detect(gemma_dir), dtype=torch.float32, device=torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    want = []
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    engine, runner = make_engine((model, HFTokenizer.from_dir(gemma_dir)), max_num_seqs=4, kv_tokens=1024,
                                 n_batch=8, caching=True)  # fmt: skip
    assert _together(engine, PROMPTS, 10) == want  # chunks of 8 tokens mix prefill with decode
    assert _together(engine, [LONG], 10) == [want[1]] and engine.kv.hits == 32  # its first two blocks cached
    assert engine.kv.num_used == 0


def test_layer_types_that_do_not_fit_the_layers_are_refused(gemma_dir, tmp_path):
    bad = Path(shutil.copytree(gemma_dir, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "layer_types": ["sliding_attention"] * 3}))
    with pytest.raises(UnsupportedFormatError, match="layer_types"):
        load_model(detect(bad), dtype=torch.float32, device=torch.device("cpu"))


def test_auto_picks_the_torch_backend(gemma_dir):
    """llama.cpp would run these Gemmas as another model (their layer pattern and attention scale are not its
    own), so `--backend auto` picks torch on any machine."""
    from quantserve.backends.select import choose_backend

    assert choose_backend(detect(gemma_dir), "auto")[0] == "torch"


def test_bits_budget_sensitivity_equals_transformers_with_that_linear_rounded(gemma_dir, tmp_path):
    """--bits-budget's sensitivity pass runs each Gemma layer with its window, rope, norms (1 + w), scaled
    embedding and final cap: the KL it reports for a linear equals transformers' KL between the model and the
    model with that linear alone rounded (RTN 4-bit), for a windowed layer's q and a global layer's down."""
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.converters.calibration.recipes import sensitivity
    from quantserve.quant.rtn import quantize_rtn

    tokens = torch.tensor([LONG])
    found = sensitivity(gemma_dir, tokens, 4, 32, progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(ref(tokens).logits[0], -1)
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            linear = ref.get_submodule(name)
            w = linear.weight.clone()
            linear.weight.copy_(quantize_rtn(w, 4, 32, True, torch.float16, name).dequantize().t())
            got = torch.log_softmax(ref(tokens).logits[0], -1)
            linear.weight.copy_(w)
            kl = float((want.exp() * (want - got)).sum(-1).mean())
            assert found.kl[name] == pytest.approx(kl, rel=1e-3, abs=1e-7), name
    quantize_checkpoint(gemma_dir, tmp_path / "q", "rtn", group_size=32, bits_budget=7.0, calib_tokens=tokens,
                        progress=False)  # fmt: skip
    dynamic = json.loads((tmp_path / "q/config.json").read_text())["quantization_config"]["dynamic"]
    assert dynamic and load_model(detect(tmp_path / "q"), dtype=torch.float32, device=torch.device("cpu"))


def test_awqs_scales_leave_a_gemma_block_computing_what_it_did(gemma_dir):
    """AWQ folds q|k|v's scale into the input norm and gate|up's into the norm before the MLP (Gemma's own), held
    as 1 + w; the other two into v's and up's rows."""
    assert_awq_folding_keeps_the_block(gemma_dir, 64)


@pytest.mark.parametrize("method", ["gptq", "rtn", "awq", "awq-gptq"])
def test_gptq_rtn_and_awq_checkpoints_of_gemma_serve_as_transformers_dequantized(method, gemma_dir, tmp_path):
    """`quantserve convert --quant gptq|rtn|awq` on Gemma: each layer calibrated with its own window and rope,
    its norms written back as stored (w, not 1 + w; AWQ's rescaled (1 + w) / s - 1); the torch backend serves the checkpoint with transformers'
    logits on it dequantized exactly, and `--backend auto` picks the torch backend for it on this CPU."""
    from safetensors.torch import load_file

    from quantserve.backends.select import choose_backend
    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.quant.dequantize import dequantize_checkpoint

    tokens = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
    out = tmp_path / method
    quantize_checkpoint(gemma_dir, out, method, group_size=32, calib_tokens=tokens, progress=False)
    src, q = load_file(gemma_dir / "model.safetensors"), load_file(out / "model.safetensors")
    norm = "model.layers.2.post_feedforward_layernorm.weight"
    assert torch.equal(q[norm], src[norm])  # the norm as the checkpoint stores it
    assert choose_backend(detect(out), "auto")[0] == "torch"
    ours = load_model(detect(out), dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours.model.layers[2].self_attn.q_proj, QuantLinear)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        dequantize_checkpoint(out, tmp_path / "dq", dtype="float32"), dtype=torch.float32
    ).eval()
    assert_logits_match(ours, ref, LONG)
    if method.startswith(
        "awq"
    ):  # 8 bits: what AWQ stored (rescaled norms included) is the model it started from
        quantize_checkpoint(gemma_dir, tmp_path / "q8", method, bits=8, group_size=32, fmt="gptq",
                            calib_tokens=tokens, progress=False)  # fmt: skip
        assert_close_to_dense(
            gemma_dir, dequantize_checkpoint(tmp_path / "q8", tmp_path / "dq8", dtype="float32")
        )


def assert_close_to_dense(
    dense: Path, quantized: Path, tokens: list[int] = LONG, bound: float = 0.05
) -> None:
    """Logits of a (dequantized) quantized checkpoint within `bound` of its dense source's (mean relative)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        want = (
            transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()(ids).logits
        )
        got = (
            transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
            .eval()(ids)
            .logits
        )
    err = float((got - want).abs().mean() / want.abs().mean())
    assert err < bound, f"mean relative logit error {err:.3f} against the dense model"


def test_inspect_names_the_windowed_layers(gemma_dir):
    from quantserve.formats.summary import _hf_windows, render_summary, summarize

    s = summarize(gemma_dir)
    local = 2 if gemma_dir.name.startswith("gemma2") else 3
    assert s.windows == f"{local} of 4 layers within 6 tokens, {4 - local} global"
    assert f"attention windows: {s.windows}" in render_summary(s)
    # configs from before layer_types: Gemma 2 alternates, Gemma 3 has a pattern
    old = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 12, "sliding_window": 512}
    assert (
        _hf_windows({**old, "architectures": ["Gemma2ForCausalLM"]})
        == "6 of 12 layers within 512 tokens, 6 global"
    )
    gemma3 = {**old, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 6}
    assert _hf_windows(gemma3) == "10 of 12 layers within 512 tokens, 2 global"


def test_gemma3s_multimodal_checkpoint_serves_its_language_model(smollm2_gguf, tmp_path):
    """Gemma3ForConditionalGeneration (what most Gemma 3 checkpoints are): its language model, under
    `model.language_model.*`, gives the wrapper's own text-only logits, the vision tower left unread; and GPTQ of
    that language model keeps the vision side as it was."""
    _, config_cls, extra = FAMILIES["gemma3"]
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(text_config=config_cls(**SIZES, **extra).to_dict(), vision_config=vision,
                                       mm_tokens_per_image=4)  # fmt: skip
    hf = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if name.endswith("norm.weight") else 0.1)
    hf.eval().save_pretrained(tmp_path)
    assert any(k.startswith("model.vision_tower.") for k in hf.state_dict())
    ours = load_model(detect(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    assert ours.args.arch == "gemma3_text" and ours.args.rope_local_theta == 10000.0
    assert_logits_match(ours, hf, LONG)
    # GPTQ of its language model: the vision side carried over byte for byte and named as dense in the config
    from safetensors.torch import load_file

    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from quantserve.quant.dequantize import dequantize_checkpoint

    tokens = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    q = quantize_checkpoint(
        tmp_path, tmp_path / "q", "gptq", group_size=32, calib_tokens=tokens, progress=False
    ).path
    src, out = load_file(tmp_path / "model.safetensors"), load_file(q / "model.safetensors")
    vision = [k for k in src if "vision_tower." in k or "multi_modal_projector." in k]
    assert vision and all(torch.equal(out[k], src[k]) for k in vision)
    dynamic = json.loads((q / "config.json").read_text())["quantization_config"]["dynamic"]
    assert any("fc1" in k and k.startswith("-:") for k in dynamic)  # no loader looks for a quantized fc1
    ours = load_model(detect(q), dtype=torch.float32, device=torch.device("cpu"))
    dq = dequantize_checkpoint(q, tmp_path / "dq", dtype="float32")
    assert_logits_match(ours, transformers.AutoModelForImageTextToText.from_pretrained(dq).eval(), LONG)


def test_a_sparse_gemma3_config_reads_with_gemma3s_defaults():
    """Gemma 3's multimodal configs give only what differs from Gemma3TextConfig's defaults (google/gemma-3-4b-it's
    text_config, as published): the rest is Gemma 3's, not the generic fallbacks."""
    from quantserve.backends.torch.args import ModelArgs

    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"},
    }  # fmt: skip
    a = ModelArgs.from_hf_config(cfg)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.vocab_size) == (8, 4, 256, 262208)
    assert (a.rope_theta, a.rope_local_theta, a.max_position_embeddings) == (1e6, 1e4, 131072)
    assert dict(a.rope_scaling) == {"factor": 8.0, "rope_type": "linear"} and a.query_pre_attn_scalar == 256
    assert a.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert a.tie_word_embeddings and not a.attn_softcap and not a.final_softcap


def test_the_plan_says_the_windows_save_no_kv_memory(gemma_dir):
    from quantserve.backends.torch.backend import TorchBackend
    from quantserve.core.settings import EngineSettings

    plan = TorchBackend().plan(detect(gemma_dir), EngineSettings(max_num_seqs=1), "asked for")
    local = 2 if gemma_dir.name.startswith("gemma2") else 3
    assert any(
        f"attend within 6 tokens in {local} of 4 layers" in s and "save no KV memory" in s for s in plan.steps
    )


def test_calibration_feeds_each_gemma_layer_what_transformers_does(gemma_dir, monkeypatch):
    """The calibration pass runs each layer with its own window and rope, from the scaled embedding: the input
    GPTQ sees at every layer is transformers' hidden state there (8-bit GPTQ, whose rounding of the layers before
    moves it by a little; a wrong window or rope would move it by far more)."""
    from quantserve.converters.calibration import driver

    seen = []
    real = driver.LAYER_METHODS["gptq"]

    def spy(block, hidden, rope, opt):
        seen.append(hidden.clone())
        return real(block, hidden, rope, opt)

    monkeypatch.setitem(driver.LAYER_METHODS, "gptq", spy)
    tokens = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    for _ in driver.quantize_model(
        gemma_dir, "gptq", bits=8, group_size=32, calib_tokens=tokens, progress=False
    ):
        pass
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = ref(tokens, output_hidden_states=True).hidden_states
    assert len(seen) == 4
    for i, h in enumerate(seen):
        err = (h - states[i]).abs().mean() / states[i].abs().mean()
        assert err < 1e-2, f"layer {i}: relative error {err:.2e}"


def test_quantserve_run_serves_a_gptq_gemma3_through_the_openai_client(gemma_dir, tmp_path):
    """`quantserve run GPTQ_DIR` on this CPU: `--backend auto` takes the torch backend, as this Gemma's layer
    pattern and attention scale are not llama.cpp's, and the official client gets a completion and a chat answer. (Greedy tokens are compared
    above; test_convert_gemma serves one through llama.cpp.)"""
    if not gemma_dir.name.startswith("gemma3"):
        pytest.skip("one family is enough for the server round trip")
    pytest.importorskip("openai")
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from tests.conftest import ask_openai, start_server

    tokens = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    quantize_checkpoint(gemma_dir, tmp_path / "q", "gptq", group_size=32, calib_tokens=tokens, progress=False)
    srv = start_server(tmp_path, str(tmp_path / "q"))
    ask_openai(srv)
    assert "llama.cpp cannot be given this checkpoint" in srv.log()
