"""HF <-> GGUF for Gemma 2 and Gemma 3 on tiny random-weight checkpoints with SmolLM2's tokenizer and windows
(4 tokens) shorter than the prompt: the GGUF equals convert_hf_to_gguf.py's key for key and byte for byte (norms
stored as 1 + w, Gemma 3's local rope base), llama.cpp runs it as transformers does, GGUF -> HF gives the same
weights and logits back, and configs llama.cpp would run as another model are refused by name.

llama.cpp's Gemma 2 converter reads only a SentencePiece tokenizer.model; its oracle here runs with Gemma 2's
set_vocab swapped for the byte-level BPE reader that its Gemma 3 converter uses (everything else is its own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from quantserve.converters import gguf_to_hf, hf_to_gguf
from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats import read_gguf_info
from tests.conftest import convert_with_llama_cpp
from tests.gguf.test_convert_hf_to_gguf import IDS, _weights, llama_logits, tensor_bytes
from tests.gguf.test_convert_phi3 import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

SIZES = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, query_pre_attn_scalar=32, sliding_window=4, max_position_embeddings=512, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
)  # fmt: skip
FAMILIES = {
    # alternating windowed and global layers, tanh caps on attention and final logits
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config, {"num_hidden_layers": 4}),
    # five windowed layers to one global, q/k norms, local rope 10k and a linearly scaled global one
    "gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        {
            "num_hidden_layers": 6,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        },
    ),
}
ORACLE = '''"""convert_hf_to_gguf.py with Gemma 2 reading tokenizer.json's byte-level BPE, as its Gemma 3 does."""
import runpy, sys
from pathlib import Path

sys.path.insert(0, str(Path(sys.argv[1]).parent))
from conversion.gemma import Gemma2Model

Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.fixture(scope="module")
def checkpoints(smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    tok = tmp_path_factory.mktemp("tokenizer")
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(tok)
    out = {}
    for name, (model_cls, config_cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**SIZES, **extra))
        with torch.no_grad():
            for key, p in model.named_parameters():
                p.normal_(0, 0.3 if key.endswith("norm.weight") else 0.1)
        d = tmp_path_factory.mktemp(name)
        # llama.cpp's converter adds the norms' 1 in float16 to an F16 checkpoint (so 1 + w rounds; checked byte
        # for byte), and in float32 to a BF16 one (widened first)
        model.to(torch.float16 if name == "gemma2" else torch.bfloat16).save_pretrained(d)
        for f in tok.iterdir():
            shutil.copy(f, d / f.name)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def oracles(vendored, checkpoints, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("oracle")
    (tmp / "oracle.py").write_text(ORACLE)
    return {
        name: convert_with_llama_cpp(vendored, src, tmp / f"{name}-f16.gguf", tmp, wrapper=tmp / "oracle.py")
        for name, src in checkpoints.items()
    }


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_equals_convert_hf_to_gguf(name, checkpoints, oracles, tmp_path):
    ours = hf_to_gguf(checkpoints[name], tmp_path / "ours.gguf", "f16", progress=False)
    kv, ref = read_gguf_info(ours).metadata, read_gguf_info(oracles[name]).metadata
    expected = {k: v for k, v in ref.items() if k != "tokenizer.ggml.add_eos_token"}  # see test_convert_llava
    assert list(kv) == list(expected) and kv == expected
    assert kv[f"{name}.attention.sliding_window"] == 4
    assert list(tensor_bytes(ours).items()) == list(tensor_bytes(oracles[name]).items())


def test_the_language_model_of_a_multimodal_gemma3_converts_as_llama_cpp_converts_it(
    vendored, smollm2_gguf, tmp_path
):
    """Gemma3ForConditionalGeneration (hub layout: `language_model.model.*`, a SigLIP tower and a projector): its
    text GGUF equals convert_hf_to_gguf.py's, which drops the vision side (llama.cpp writes that to an mmproj)."""
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf

    text = {k: v for k, v in SIZES.items() if not k.endswith("token_id")} | {"num_hidden_layers": 6}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=49151, boi_token_index=49150, eoi_token_index=49149)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.normal_(0, 0.3 if key.endswith("norm.weight") else 0.1)
    src = tmp_path / "mm"
    model.to(torch.bfloat16).save_pretrained(src)
    tokenizer_from_gguf(read_gguf_info(smollm2_gguf).metadata).save(src)
    oracle = convert_with_llama_cpp(vendored, src, tmp_path / "oracle.gguf", tmp_path)
    ours = hf_to_gguf(src, tmp_path / "ours.gguf", "f16", progress=False)
    kv, ref = read_gguf_info(ours).metadata, read_gguf_info(oracle).metadata
    assert kv == {k: v for k, v in ref.items() if k != "tokenizer.ggml.add_eos_token"}
    assert list(tensor_bytes(ours).items()) == list(tensor_bytes(oracle).items())
    assert not any(t.name.startswith(("v.", "mm.")) for t in read_gguf_info(ours).tensors)


@pytest.mark.parametrize("name", FAMILIES)
def test_llama_cpp_runs_it_as_transformers_does(name, checkpoints, tmp_path):
    out = hf_to_gguf(checkpoints[name], tmp_path / "m.gguf", "f16", progress=False)
    ours, ref = llama_logits(out), hf_logits(checkpoints[name], IDS)  # 8 tokens, past the 4-token window
    assert np.abs(ours - ref).mean() / np.abs(ref).mean() < 5e-3  # F16 weights and KV cache
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_to_hf_round_trip_is_exact(name, checkpoints, tmp_path):
    src = checkpoints[name]
    back = gguf_to_hf(hf_to_gguf(src, tmp_path / "m.gguf", "f32", progress=False), tmp_path / "hf", "fp32")
    original, ours = _weights(src), _weights(back)
    assert ours.keys() == original.keys()
    for key, value in original.items():
        # Gemma 2's GGUF holds f16(1 + w): w comes back to within float16's step at 1
        atol = 2**-11 if key.endswith("norm.weight") and name == "gemma2" else 0
        np.testing.assert_allclose(ours[key], value, rtol=0, atol=atol, err_msg=key)
    config = json.loads((back / "config.json").read_text())
    assert config["layer_types"] == json.loads((src / "config.json").read_text())["layer_types"]
    ids = IDS * 5
    tol = 1e-4 if name == "gemma3" else 1e-2  # Gemma 2: its norms moved by up to 2**-11
    np.testing.assert_allclose(hf_logits(back, ids), hf_logits(src, ids), rtol=tol, atol=tol)


def _edited(src: Path, tmp_path: Path, **changes) -> Path:
    d = Path(shutil.copytree(src, tmp_path / "edited"))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **changes}))
    return d


def test_what_llama_cpp_would_compute_differently_is_refused(checkpoints, tmp_path):
    src = _edited(checkpoints["gemma3"], tmp_path, query_pre_attn_scalar=24)
    with pytest.raises(UnsupportedFormatError, match="query_pre_attn_scalar 24.*1/sqrt\\(32\\)"):
        hf_to_gguf(src, tmp_path / "a.gguf", "f16", progress=False)
    types = ["sliding_attention", "full_attention"] * 3  # Gemma 2's alternation in a Gemma 3
    src = _edited(checkpoints["gemma3"], tmp_path / "b", layer_types=types)
    with pytest.raises(UnsupportedFormatError, match="every 6th layer global"):
        hf_to_gguf(src, tmp_path / "b.gguf", "f16", progress=False)
    assert not list(tmp_path.glob("*.gguf"))


def test_quantserve_run_serves_a_gptq_gemma3_via_the_cpu_route(checkpoints, tmp_path):
    """`quantserve run GPTQ_DIR` on this CPU: dequantized, converted to GGUF and served by llama.cpp (auto's CPU
    choice), and asked through the official client."""
    pytest.importorskip("openai")
    from quantserve.converters.calibration.quantize import quantize_checkpoint
    from tests.conftest import ask_openai, start_server

    tokens = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    q = tmp_path / "q"
    quantize_checkpoint(checkpoints["gemma3"], q, "gptq", group_size=32, calib_tokens=tokens, progress=False)
    srv = start_server(tmp_path, str(q), "--no-cache", "--cache-dir", str(tmp_path / "c"))
    ask_openai(srv)
    assert "after dequantization and conversion to GGUF" in srv.log()


@pytest.fixture(scope="module")
def spm_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Both families with a SentencePiece tokenizer.model (BPE with byte fallback, trained here on the calibration
    text) as real Gemma checkpoints ship it, 400 pieces under 408 embedding rows, special and added tokens."""
    spm = pytest.importorskip("sentencepiece")
    from importlib import resources

    tmp = tmp_path_factory.mktemp("spm")
    corpus = tmp / "corpus.txt"
    corpus.write_text(
        (resources.files("quantserve") / "data" / "calib.txt").read_text(encoding="utf-8")[:200_000]
    )
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp / "sp"), vocab_size=400, model_type="bpe", byte_fallback=True,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        minloglevel=2, num_threads=1,
    )  # fmt: skip
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
              "unk_token": "<unk>", "chat_template": "{% for m in messages %}<start_of_turn>{{ m['content'] }}{% endfor %}",
              "added_tokens_decoder": {"4": {"content": "<start_of_turn>", "special": True},
                                       "5": {"content": "<end_of_turn>", "special": True}}}  # fmt: skip
    out = {}
    for name, (model_cls, config_cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**SIZES, "vocab_size": 408}, **extra))
        with torch.no_grad():
            for key, p in model.named_parameters():
                p.normal_(0, 0.3 if key.endswith("norm.weight") else 0.1)
        d = out[name] = tmp / name
        model.to(torch.bfloat16).save_pretrained(d)
        shutil.copy(tmp / "sp.model", d / "tokenizer.model")
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        (d / "added_tokens.json").write_text(json.dumps({"<extra>": 401}))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_a_sentencepiece_tokenizer_model_converts_as_llama_cpp_converts_it(
    name, vendored, spm_checkpoints, tmp_path
):
    """With tokenizer.model (what llama.cpp's Gemma converters read, with the sentencepiece library; quantserve
    parses the protobuf itself): every key, in order, and every tensor byte equal convert_hf_to_gguf.py's, the
    vocab padded to the embedding's rows; llama.cpp runs the file as transformers runs the checkpoint."""
    import llama_cpp

    src = spm_checkpoints[name]
    oracle = convert_with_llama_cpp(vendored, src, tmp_path / "oracle.gguf", tmp_path, sentencepiece=True)
    ours = hf_to_gguf(src, tmp_path / "ours.gguf", "f16", progress=False)
    kv, ref = read_gguf_info(ours).metadata, read_gguf_info(oracle).metadata
    assert list(kv.items()) == list(ref.items())
    assert list(tensor_bytes(ours).items()) == list(tensor_bytes(oracle).items())
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(tokens) == 408 and tokens[404:] == [f"[PAD{i}]" for i in range(404, 408)]
    assert (types[4], types[401], tokens[401], types[10]) == (3, 4, "<extra>", 6)  # control, added, a byte
    ids = [2, 17, 90, 150, 211, 300, 399, 42]
    llm = llama_cpp.Llama(str(ours), n_ctx=64, flash_attn=False, n_threads=1, verbose=False, logits_all=True)
    llm.eval(ids)
    got, want = np.asarray(llm.scores[: len(ids)]), hf_logits(src, ids)
    assert (
        np.abs(got - want).mean() / np.abs(want).mean() < 5e-3 and (got.argmax(-1) == want.argmax(-1)).all()
    )


def test_a_malformed_tokenizer_model_is_refused_by_name(spm_checkpoints, tmp_path):
    from quantserve.gguf.spm import spm_vocab

    src = Path(shutil.copytree(spm_checkpoints["gemma3"], tmp_path / "bad"))
    for decoder in ([1, 2], {"²": {"content": "x"}, "7": "x", "8": {"content": 3}}):  # ignored, never a crash
        (src / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
        assert len(spm_vocab(src, {"vocab_size": 408}).tokens) == 408
    (src / "tokenizer_config.json").write_text("[" * 100_000)
    with pytest.raises(ModelFileError, match="tokenizer_config.json: cannot parse JSON"):
        spm_vocab(src, {"vocab_size": 408})
    (src / "tokenizer.model").write_bytes((src / "tokenizer.model").read_bytes()[:1000])
    with pytest.raises(ModelFileError, match="tokenizer.model.*not a SentencePiece model"):
        hf_to_gguf(src, tmp_path / "m.gguf", "f16", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_what_llama_cpp_runs_by_default_is_read_as_it_runs_it():
    """A gemma2 GGUF without a window key runs llama.cpp's 4096 on every other layer, and GGUF -> HF says so; a
    Gemma 3 whose every layer is global (sliding_window_pattern 1) converts, as llama.cpp writes and runs no
    window for it."""
    from quantserve.gguf.archs import archs
    from quantserve.gguf.params import conversion_refusal

    sizes = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}
    config = archs()["gemma2"].gguf_config({}, sizes)
    assert config["sliding_window"] == 4096 and config["layer_types"][:2] == [
        "sliding_attention",
        "full_attention",
    ]
    gemma3 = {
        **sizes,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": 16,
    }
    assert conversion_refusal({**gemma3, "sliding_window_pattern": 1}) is None
    assert "every 6th layer global" in conversion_refusal({**gemma3, "sliding_window_pattern": 2})


def _logits(runner, tokens: list[int], computed: int) -> np.ndarray:
    """The last position's logits for `tokens` in slot 0, whose first `computed` are taken as in its KV (prefill
    in chunks of 16, as the engine's n_batch)."""
    import llama_cpp as lc

    from quantserve.core.detokenizer import IncrementalDetokenizer
    from quantserve.core.sampling_params import SamplingParams
    from quantserve.core.sequence import Sequence

    seq = Sequence("s", list(tokens), SamplingParams(temperature=0.0, max_tokens=1), IncrementalDetokenizer(),
                   max_total_tokens=512)  # fmt: skip
    seq.block_table, seq.num_computed = [0], computed
    while seq.num_uncomputed:
        n = min(16, seq.num_uncomputed)
        runner.execute([(seq, n)])
        seq.num_computed += n
    runner.release(seq)
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(runner.ctx, -1), shape=(runner.n_vocab,)).copy()


def test_the_ledger_reuses_only_what_llama_cpps_window_cache_still_holds(checkpoints, tmp_path):
    """swa_full off (the default, as llama-server): the windowed layers keep 256 cells here, so a 400-token
    sequence has overwritten the start of its windowed KV. Resuming it after 30 tokens then gives other logits
    than computing them again (the test can fail), and the ledger recomputes such a prompt from 0; resuming after
    everything it computed (a chat's next turn), which the ledger reuses, gives the logits of a fresh run."""
    from quantserve.backends.llamacpp.backend import LlamaCppBackend
    from quantserve.backends.llamacpp.model import LlamaCppRunner
    from quantserve.core.runner import DropKV
    from quantserve.core.settings import EngineSettings
    from quantserve.engine.kv import make_kv
    from quantserve.formats import detect
    from tests.engine.test_kv_paged import seq

    gguf = hf_to_gguf(checkpoints["gemma3"], tmp_path / "m.gguf", "f16", progress=False)
    settings = EngineSettings.from_options(ctx_size=512, max_num_seqs=1, threads=1, n_batch=16)
    steps = LlamaCppBackend().plan(detect(gguf), settings, "asked for").steps
    assert any("keep each sequence's last 4 positions" in step for step in steps)
    runner = LlamaCppRunner(gguf, settings)
    try:
        assert runner.kv_spec.window == 4
        long = list(range(1000, 1400))
        edit, more = long[:30] + list(range(2000, 2010)), long + [5, 6, 7]
        _logits(runner, long, 0)
        runner.drop_kv([DropKV(0, 30)])
        stale = _logits(runner, edit, 30)
        runner.drop_kv([DropKV(0)])
        assert not np.allclose(stale, _logits(runner, edit, 0), atol=1e-3)
        runner.drop_kv([DropKV(0)])
        _logits(runner, long, 0)
        resumed = _logits(runner, more, 400)
        runner.drop_kv([DropKV(0)])
        np.testing.assert_allclose(resumed, _logits(runner, more, 0), atol=1e-4, rtol=1e-4)
        kv = make_kv(runner.kv_spec, prefix_caching=True)
    finally:
        runner.close()
    done = seq(long)
    kv.allocate(done)
    done.num_computed = 400
    kv.deallocate(done)
    for tokens, reused in ((more, 400), (edit, 0)):  # (each leaves what it reused cached)
        s = seq(tokens)
        kv.allocate(s)
        assert s.num_computed == reused
        kv.deallocate(s)
