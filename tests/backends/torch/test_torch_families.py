"""Mixtral, Phi-3 and windowed Phi-3 and Mistral under the torch backend's engine, on tiny random-weight checkpoints with SmolLM2's tokenizer: 4
requests of different lengths batched under paged KV with prefix caching give transformers' greedy tokens for each
alone (test_torch_moe.py does the same for Qwen3-MoE)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import triton  # noqa: F401 - before any test sets TRITON_INTERPRET (see tests/kernels/test_w4a16_kernels.py)

from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.backends.torch.weights import load_model
from quantserve.formats import detect, read_gguf_info
from tests.backends.torch.test_torch_engine import make_engine
from tests.backends.torch.test_torch_moe import LONG, PROMPTS, _together

SIZES = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2)  # fmt: skip
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    ),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**SIZES, pad_token_id=0)),
    # every layer within 8 tokens: the prompts but the last run past it, and prefix caching must not change that
    "phi3-window": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**SIZES, pad_token_id=0, sliding_window=8)
    ),
    "mistral-window": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**SIZES, sliding_window=8)
    ),
}


@pytest.fixture(scope="module")
def checkpoints(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    out = {}
    for family, build in FAMILIES.items():
        torch.manual_seed(0)
        model = build()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    p.normal_(0, 1.0)  # a router that prefers some experts
                else:
                    p.normal_(0, 0.1)
        d = tmp_path_factory.mktemp(f"tiny-{len(out)}")
        model.save_pretrained(d)
        tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(d)
        out[family] = d
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_with_prefix_caching_equals_transformers_alone(family, checkpoints):
    src = checkpoints[family]
    model = load_model(detect(src), dtype=torch.float32, device=torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    want = []
    for p in PROMPTS:
        out = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    engine, _ = make_engine((model, HFTokenizer.from_dir(src)), max_num_seqs=4, kv_tokens=1024, n_batch=8,
                            caching=True)  # fmt: skip
    assert _together(engine, PROMPTS, 10) == want  # chunks of 8 tokens mix prefill with decode
    assert _together(engine, [LONG], 10) == [want[1]] and engine.kv.hits == 32  # its first two blocks cached
    assert engine.kv.num_used == 0


def test_a_checkpoint_with_one_tensor_under_two_names_is_refused(tmp_path):
    """Mixtral's `block_sparse_moe.experts.0.w1` is quantserve's `mlp.experts.0.gate_proj`: a checkpoint holding
    both names is refused by the quantizers' reader, not read with one silently dropped."""
    from safetensors.torch import save_file

    from quantserve.backends.torch.args import ModelArgs
    from quantserve.converters.calibration.driver import SafetensorsReader
    from quantserve.errors import ModelFileError

    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
    args = ModelArgs.from_hf_config(config)
    w = torch.zeros(4, 4)
    save_file({"model.layers.0.block_sparse_moe.experts.0.w1.weight": w,
               "model.layers.0.mlp.experts.0.gate_proj.weight": w.clone()}, tmp_path / "m.safetensors")  # fmt: skip
    with pytest.raises(ModelFileError, match="which are one tensor"):
        SafetensorsReader([tmp_path / "m.safetensors"], args.our_name)


def _edited(src: Path, dst: Path, **changes) -> Path:
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_an_unknown_rope_scaling_is_refused_before_any_weight_loads(checkpoints, tmp_path):
    from quantserve.converters import hf_to_gguf
    from quantserve.errors import UnsupportedFormatError

    bad = _edited(
        checkpoints["mistral-window"],
        tmp_path / "bad",
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    )
    with pytest.raises(
        UnsupportedFormatError, match="rope scaling 'dynamic' is not supported by the torch backend"
    ):
        load_model(detect(bad), dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(UnsupportedFormatError, match="rope type 'dynamic' is not supported for conversion"):
        hf_to_gguf(bad, tmp_path / "m.gguf", "f16", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_a_window_longer_than_the_context_is_read_as_none(checkpoints, tmp_path):
    """Phi-3-mini-128k's config has a 262144-token window over 131072 positions: not an error, as it never
    applies; the model is transformers' and the plan and inspect say that the window never applies."""
    from quantserve.backends.torch.backend import TorchBackend
    from quantserve.core.settings import EngineSettings
    from quantserve.formats.summary import render_summary, summarize

    src = _edited(checkpoints["phi3"], tmp_path / "long", sliding_window=1024)  # 512 positions
    model = load_model(detect(src), dtype=torch.float32, device=torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = ref(torch.tensor([LONG])).logits, model.compute_logits(model(torch.tensor([LONG])))
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    steps = TorchBackend().plan(detect(src), EngineSettings(max_num_seqs=1), "asked for").steps
    assert any("sliding_window 1024 is not shorter than the model's 512-token context" in s for s in steps)
    assert "not shorter than the 512-token context: none applies" in render_summary(summarize(src))
