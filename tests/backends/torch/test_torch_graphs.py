"""Decode steps through DecodeGraphs' static buffers give the tokens and logits of eager steps, as the batch grows
and shrinks, and write nothing outside the sequences' own blocks but the scratch block. On the CPU the buffers run
through the eager forward (capture=False) with the paged kernel interpreted; on CUDA the graphs are captured and
replayed, in fp16, with int4 weights."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 - before any test sets TRITON_INTERPRET (see tests/kernels/test_w4a16_kernels.py)

from quantserve.backends.torch.graphs import capture_sizes
from quantserve.backends.torch.runner import TorchRunner
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.core.settings import EngineSettings

TINY = dict(
    architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=256, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=256,
)  # fmt: skip
# Gemma 2: every other layer within 8 positions (the prompts run past it), attention scores capped
GEMMA2 = {**TINY, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 64, "sliding_window": 8,
          "query_pre_attn_scalar": 64, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0}  # fmt: skip
CONFIGS = {"llama": TINY, "gemma2": GEMMA2}
PROMPT_LENS = (5, 17, 9, 33, 12)
BS = 16


def tiny_model(dtype: torch.dtype, device: torch.device, int4: bool, config: dict = TINY):
    """A random Llama (or `config`) whose logits have wide margins (a large lm_head): clear-cut greedy picks."""
    from quantserve.backends.torch.fuse import fuse_projections
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.backends.torch.weights import _empty_model, _set_module, decoder_linears
    from quantserve.quant.rtn import quantize_rtn

    torch.manual_seed(0)
    model = _empty_model(ModelArgs.from_hf_config(config), dtype, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (1.0 if "norm" in name else 0.5 if "lm_head" in name else 0.08))
    if int4:
        for prefix in decoder_linears(model):
            qw = quantize_rtn(model.get_submodule(prefix).weight.detach().float().cpu(), 4, 64, True)
            _set_module(
                model, prefix, QuantLinear.from_quantized(qw, None, dtype=dtype, device=device, name=prefix)
            )
    fuse_projections(model)  # as the server's loader does
    return model.eval()


def decode_run(model, device: torch.device, mode: str, steps: int = 12):
    """Greedy tokens of five sequences (prefilled alone, then decoded together; two finish early, so the batch
    shrinks from 5 to 3 and a smaller bucket reuses rows a larger step left), each step's logits, and the runner.

    mode: "gather" (eager, cells gathered for SDPA, PyTorch ops), "kernel" (eager, paged kernel and the fused
    kernels), "buffers" (the graphs' static buffers run eagerly) or "graphs" (captured CUDA graphs)."""
    settings = EngineSettings.from_options(
        ctx_size=128, max_num_seqs=5, kv_size=1024, cuda_graphs=mode == "graphs"
    )
    runner = TorchRunner(model, None, settings, device)
    runner.paged_kernel = mode != "gather"
    model.use_fused_kernels(mode != "gather")  # the oracle runs PyTorch's own ops throughout
    if mode == "buffers":
        runner.graphs = runner.decode_graphs(capture=False)
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i, n in enumerate(PROMPT_LENS):
        s = Sequence(str(i), torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(temperature=0.0),
                     IncrementalDetokenizer(), 128)  # fmt: skip
        s.block_table = [i * 8 + j for j in (3, 0, 5, 1, 7, 2, 6, 4)]  # scattered blocks, 8 per sequence
        seqs.append(s)
    out: list[list[int]] = [[] for _ in seqs]
    logits = []
    for s in seqs:
        (tok,) = runner.execute([(s, len(s.tokens))])
        s.num_computed = len(s.tokens)  # what the scheduler does after a step
        s.tokens.append(tok.token)
        out[int(s.request_id)].append(tok.token)
    live = list(seqs)
    for t in range(steps):
        if t == 4:  # two finish: their blocks are free now (zeroed here), so nothing may write there again
            for gone in (live[1], live[3]):
                for layer in model.model.layers:
                    for blk in gone.block_table:
                        layer.self_attn.cache.k[blk * BS : (blk + 1) * BS] = 0
                        layer.self_attn.cache.v[blk * BS : (blk + 1) * BS] = 0
                gone.num_computed = 0
            live = [live[0], live[2], live[4]]
        capture = {}
        original = runner.sampler.sample

        def spy(lg, sq, _capture=capture, _original=original):
            _capture["logits"] = lg.detach().float().cpu().clone()
            return _original(lg, sq)

        runner.sampler.sample = spy
        toks = runner.execute([(s, 1) for s in live])
        runner.sampler.sample = original
        logits.append(capture["logits"])
        for s, tok in zip(live, toks, strict=True):
            s.num_computed += 1
            s.tokens.append(tok.token)
            out[int(s.request_id)].append(tok.token)
    runner.test_seqs = seqs
    return out, logits, runner


def only_own_cells_written(runner: TorchRunner, scratch_ok: bool) -> None:
    """Every cache cell is zero but those holding a sequence's computed positions (and the scratch block's): a
    sequence that left the batch gets no writes after it left, as its blocks may be someone else's by then."""
    bs = runner.block_size
    written = torch.zeros(runner.model.model.layers[0].self_attn.cache.k.shape[0], dtype=torch.bool)
    for s in runner.test_seqs:
        for p in range(s.num_computed):
            written[s.block_table[p // bs] * bs + p % bs] = True
    if scratch_ok:
        scratch = runner.n_kv_cells // bs
        written[scratch * bs : (scratch + 1) * bs] = True
    for layer in runner.model.model.layers:
        for cache in (layer.self_attn.cache.k, layer.self_attn.cache.v):
            stray = cache.cpu().flatten(1).any(1) & ~written
            assert not stray.any(), f"cells {stray.nonzero().flatten().tolist()[:8]} were written"


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("arch", CONFIGS)
def test_static_buffers_give_the_eager_tokens(arch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model(torch.float32, torch.device("cpu"), int4=False, config=CONFIGS[arch])
    want, want_logits, eager = decode_run(model, torch.device("cpu"), "gather")
    only_own_cells_written(eager, scratch_ok=False)  # now: the next runner gives the model its own cache
    got, got_logits, buffered = decode_run(model, torch.device("cpu"), "buffers")
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    only_own_cells_written(buffered, scratch_ok=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("int4", [False, True], ids=["fp16", "int4"])
@pytest.mark.parametrize("mode", ["kernel", "graphs"])
@pytest.mark.parametrize("arch", CONFIGS)
def test_cuda_decode_gives_the_gather_tokens(int4, mode, arch):
    """On CUDA: eager steps with the paged kernel, and captured graphs, against eager gather-then-SDPA steps (a
    Gemma 2 too: its windowed layers and capped scores in the kernel, so in the graphs)."""
    cuda = torch.device("cuda")
    model = tiny_model(torch.float16, cuda, int4=int4, config=CONFIGS[arch])
    want, want_logits, _ = decode_run(model, cuda, "gather")
    got, got_logits, runner = decode_run(model, cuda, mode)
    assert (runner.graphs is not None and len(runner.graphs.graphs) == 4) == (mode == "graphs")
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        # fp16 with other kernels and other summation orders: within a few fp16 ulps of the logits' scale (an
        # H100 run measured 0.031 on logits of scale 23, 1.4e-3 of it)
        assert (a - b).abs().max() <= 4e-3 * b.abs().max(), (a - b).abs().max()
    only_own_cells_written(runner, scratch_ok=True)
