"""Tensor parallel on two gloo ranks (this process and one it starts) against one rank, on the same weights: the prompt
log-probabilities within 1e-4 and the greedy tokens equal, with 4 requests batched, chunked prefill and prefix
caching on; dense, int4 at load, a GPTQ checkpoint, and a Qwen3-MoE. What cannot split is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from quantserve.backends.torch.backend import TorchBackend
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.core.settings import EngineSettings
from quantserve.engine.kv import make_kv
from quantserve.engine.llm_engine import LLMEngine
from quantserve.engine.scheduler import SchedulerConfig
from quantserve.errors import ConfigError
from quantserve.formats import detect

# k/v 64 wide per rank at TP=2 (Marlin's tiles are 64 columns); groups of 32 split evenly along K
SIZES = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)  # fmt: skip
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time there was a " * 6,
]


def _save(model, path, smollm2_hf):
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_hf / name, path / name)
    return path


@pytest.fixture(scope="module")
def llama(smollm2_hf, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    return _save(model, tmp_path_factory.mktemp("tp") / "llama", smollm2_hf)


def load(path, world: int, **options):
    options = {"threads": 1, **options}
    settings = EngineSettings.from_options(
        backend="torch", ctx_size=256, kv_size=1024, max_num_seqs=4, tensor_parallel_size=world, **options
    )  # fmt: skip
    backend = TorchBackend()
    return backend.load(backend.plan(detect(path), settings, "test")).runner


def greedy(runner, prompts: list[str], max_tokens: int = 12) -> list[list[int]]:
    """4 requests at once, 16 tokens a step (chunked prefill beside decode), prefix caching on."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_queue_len=64)
    engine = LLMEngine(runner, config, make_kv(runner.kv_spec, prefix_caching=True))
    outs = {}
    for i, p in enumerate(prompts):
        ids = runner.tokenize(p, add_special=True, parse_special=False)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add(Sequence(str(i), ids, sp, IncrementalDetokenizer(), max_total_tokens=runner.n_ctx))
        outs[str(i)] = []
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id].extend(out.token_ids)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # cached blocks count as free: nothing leaked
    return [outs[str(i)] for i in range(len(prompts))]


def compare(path, **options):
    """TP=2 against TP=1: prompt log-probabilities (< 1e-4 of their scale) and greedy tokens."""
    tokens = list(range(1000, 1040))
    results = {}
    for world in (1, 2):
        runner = load(path, world, **options)
        layers = getattr(runner, "inner", runner).model.model.layers
        attn = next(x for x in layers if not x.linear).self_attn  # (Qwen3.5's first layers are DeltaNets)
        assert (attn.n_heads, attn.n_kv) == (
            8 // world,
            4 // world,
        )  # this rank's slice; the other has the rest
        try:
            results[world] = (torch.from_numpy(runner.score(tokens, 0)), greedy(runner, PROMPTS))
        finally:
            runner.close()
    (one, tok1), (two, tok2) = results[1], results[2]
    assert (two - one).abs().max().item() < 1e-4 * one.abs().max().item()
    assert tok1 == tok2 and all(len(t) == 12 for t in tok1)


def test_dense_llama(llama):
    compare(llama)


def test_int4_at_load(llama):
    compare(llama, quant="int4")


def test_gptq_checkpoint(llama, tmp_path):
    from quantserve.converters.calibration.quantize import quantize_checkpoint

    tokens = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_checkpoint(llama, tmp_path / "q", "gptq", group_size=32, calib_tokens=tokens, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(llama / name, tmp_path / "q" / name)
    compare(tmp_path / "q")


def test_qwen3_moe(smollm2_hf, tmp_path):
    """Also an untied output layer and a vocabulary that does not split evenly (the last rank's rows padded)."""
    torch.manual_seed(0)
    untied = {**SIZES, "vocab_size": 49155, "tie_word_embeddings": False}
    config = transformers.Qwen3MoeConfig(
        **{k: v for k, v in untied.items() if k != "intermediate_size"}, intermediate_size=512,
        moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    )  # fmt: skip
    compare(_save(transformers.Qwen3MoeForCausalLM(config), tmp_path / "moe", smollm2_hf))


@pytest.mark.parametrize("kind", ["dense-gptq", "deltanet-gptq", "moe"])
def test_qwen35(kind, smollm2_hf, tmp_path):
    """Qwen3.5's Gated DeltaNets split by heads (each rank keeps its heads' part of every recurrent state), its gated
    attention by heads, and the MoE's shared expert like the others: dense as a GPTQ checkpoint (DeltaNets kept
    dense, or quantized too: their Marlin shares per rank), and MoE. Three DeltaNet layers and one attention layer, 2 key and 4 value heads."""
    base = {k: v for k, v in SIZES.items() if k not in ("num_hidden_layers", "intermediate_size")}
    linear = dict(num_hidden_layers=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                  linear_num_value_heads=4)  # fmt: skip
    torch.manual_seed(0)
    if kind == "moe":
        config = transformers.Qwen3_5MoeTextConfig(**base, **linear, moe_intermediate_size=128, num_experts=4,
                                                   num_experts_per_tok=2, shared_expert_intermediate_size=128)  # fmt: skip
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**base, **linear, intermediate_size=512)
        )
    with torch.no_grad():  # as test_torch_qwen35: decays and gates that matter
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1, 1)
            elif name.endswith("dt_bias"):
                p.uniform_(0, 1)
    src = _save(model, tmp_path / kind, smollm2_hf)
    if kind == "moe":
        compare(src)
        return
    from quantserve.converters.calibration.quantize import quantize_checkpoint

    tokens = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_checkpoint(src, tmp_path / "q", "gptq", group_size=32, calib_tokens=tokens, progress=False,
                        deltanet=kind == "deltanet-gptq")  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / "q" / name)
    compare(tmp_path / "q")


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_gpt_oss(kind, smollm2_hf, tmp_path):
    """gpt-oss: sinks with their heads, biases (o_proj's and each expert's down bias added once), windows shorter
    than the prompts, the clamped SwiGLU experts split within each expert on whole 32-row blocks, here unevenly
    (96 rows: 64 and 32, as the released 2880 split over 4 ranks); as MXFP4, the blocks cut, never decoded."""
    from safetensors.torch import load_file, save_file

    from quantserve.kernels import mxfp4

    base = {k: v for k, v in SIZES.items() if k not in ("intermediate_size", "tie_word_embeddings")}
    config = transformers.GptOssConfig(**base, intermediate_size=96, sliding_window=8, num_local_experts=4,
                                       num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "router.weight", "router.bias", "_bias")):
                p.normal_(0, 1.0 if "router" in name or "sinks" in name else 0.1)
    src = _save(model, tmp_path / "oss", smollm2_hf)
    if kind == "mxfp4":  # the experts as released: MXFP4 blocks of [E, out, in]
        tensors = {}
        for name, t in load_file(src / "model.safetensors").items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                b, s = mxfp4.quantize(t.transpose(1, 2))
                tensors |= {f"{name}_blocks": b, f"{name}_scales": s}
            else:
                tensors[name] = t
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
        (src / "config.json").write_text(json.dumps(cfg))
    compare(src)


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma2", "mixtral"])
def test_other_families(family, smollm2_hf, tmp_path):
    """Qwen2's q/k/v biases (column-parallel), Phi-3's fused qkv_proj and gate_up_proj (split per part), Gemma 2's
    sandwich norms, windows shorter than the prompts and both soft caps (applied after the sums and the gather),
    Mixtral's experts under their own checkpoint names (block_sparse_moe.experts.E.w1/w2/w3)."""
    base = {k: v for k, v in SIZES.items() if k != "head_dim"}
    configs = {
        "qwen2": lambda: transformers.Qwen2Config(**base),
        "phi3": lambda: transformers.Phi3Config(**base, pad_token_id=0),
        "gemma2": lambda: transformers.Gemma2Config(
            **base,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),  # fmt: skip
        "mixtral": lambda: transformers.MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2),
    }
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs[family]())
    compare(_save(model, tmp_path / family, smollm2_hf))


def test_what_cannot_split_is_refused_by_name(llama, smollm2_hf, tmp_path):
    from quantserve.converters.calibration.quantize import quantize_checkpoint

    with pytest.raises(ConfigError, match="8 attention heads .*do not split evenly over 3 ranks"):
        load(llama, 3)  # at plan time: `quantserve inspect` says so too, and no rank is started
    settings = EngineSettings.from_options(backend="torch", tensor_parallel_size=2)
    steps = TorchBackend().plan(detect(llama), settings, "test").steps
    assert any("split over 2 ranks" in s and "4 of 8 attention heads and 2 of 4 KV heads" in s for s in steps)
    # down_proj's K = 384 over 2 ranks is 192 each: groups of 128 would be cut
    torch.manual_seed(0)
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, "intermediate_size": 384}))
    src = _save(odd, tmp_path / "odd", smollm2_hf)
    tokens = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    quantize_checkpoint(src, tmp_path / "q", "rtn", group_size=128, calib_tokens=tokens, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / "q" / name)
    with pytest.raises(
        ConfigError, match=r"down_proj: its K = 384 .* 192 each, not a multiple of its group size 128"
    ):
        load(tmp_path / "q", 2)


def test_a_dead_rank_fails_the_stream_then_503(llama, tmp_path):
    """`quantserve run --tensor-parallel-size 2` answers through the official client and reports each rank's step
    time; killing rank 1 mid-stream ends the stream with an error naming it, and new requests get 503 naming it
    at once, /readyz too. `quantserve bench` reads the per-rank times."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import openai

    from tests.conftest import ROOT, start_server

    # the forward's collectives time out after 3 s here; the ranks idle longer than that between requests
    env = {"QUANTSERVE_TP_TIMEOUT": "3"}
    srv = start_server(
        tmp_path,
        str(llama),
        "--backend",
        "torch",
        "--tensor-parallel-size",
        "2",
        "--ctx-size",
        "512",
        env=env,
    )
    try:
        pid = int(re.search(r"ranks 1-1 are pids (\d+)", srv.log()).group(1))
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-", max_retries=0, timeout=60)
        time.sleep(5)  # idle past the timeout: the ranks wait for orders on a group of their own
        first = client.completions.create(model="llama", prompt="Hello", max_tokens=4, temperature=0)
        assert first.usage.completion_tokens == 4
        bench = subprocess.run(
            [sys.executable, "-m", "quantserve.cli", "bench", "--url", srv.base_url, "-c", "2", "--num-requests", "2",
             "--max-tokens", "8"], capture_output=True, text=True, cwd=ROOT, timeout=300,
        )  # fmt: skip
        assert re.search(r"per rank: rank 0 [\d.]+ s, rank 1 [\d.]+ s", bench.stdout), (
            bench.stdout + bench.stderr
        )
        metrics = httpx.get(srv.base_url + "/metrics").text
        assert "quantserve_rank_step_seconds_total{model=" in metrics and 'rank="1"' in metrics
        stream = client.completions.create(
            model="llama", prompt="Once", max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )  # fmt: skip
        got, t0 = 0, time.monotonic()
        with pytest.raises(
            openai.APIError, match=f"tensor-parallel rank 1 \\(pid {pid}\\) killed by SIGKILL"
        ):
            for _ in stream:
                got += 1
                if got == 5:
                    os.kill(pid, signal.SIGKILL)
                    t0 = time.monotonic()
        assert got < 400 and time.monotonic() - t0 < 30
        t1 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="llama", prompt="Hello", max_tokens=4)
        assert err.value.status_code == 503 and f"rank 1 (pid {pid})" in err.value.message
        assert time.monotonic() - t1 < 5
        ready = httpx.get(srv.base_url + "/readyz")
        assert ready.status_code == 503 and "rank 1" in ready.json()["error"]["message"]
    finally:
        assert srv.stop() == 0


def test_torchrun_starts_the_ranks(llama, tmp_path):
    """The multi-machine launch, on one machine: `torchrun --nproc-per-node 2 -m quantserve.cli run ...` starts
    two processes; rank 0 serves, rank 1 holds its slice, and the answer is the one-process server's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from tests.conftest import ROOT, free_port, start_server

    one = start_server(tmp_path, str(llama), "--backend", "torch")
    body = {"model": "llama", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    try:
        want = httpx.post(one.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0][
            "text"
        ]
    finally:
        one.stop()
    port, log = free_port(), tmp_path / "torchrun.log"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "quantserve.cli", "run", str(llama), "--backend", "torch",
           "--tensor-parallel-size", "2", "--port", str(port), "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ)
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want
        assert "started by torchrun" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
