"""The torch backend's model against transformers on the same weights: tiny random models of every architecture
and rope scaling, logits within 1e-3 of the logit scale, same greedy tokens, paged forward = whole-sequence forward."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from quantserve.backends.torch.model import KVCache, ModelArgs, PagedBatch, Transformer

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
    "yarn-rope": (
        transformers.LlamaConfig,
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
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
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ours = Transformer(ModelArgs.from_hf_config(cfg)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
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


@pytest.mark.parametrize("case", ["llama", "qwen3"])
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


def paged_batch(chunks: list[tuple[int, int, list[int]]], block_size: int) -> PagedBatch:
    """chunks: (n_cached_before, n_new, block_table) per sequence."""
    starts, lens, ctxs, slots, decode, prefill = [], [], [], [], [], []
    t = 0
    for i, (cached, n, table) in enumerate(chunks):
        starts.append(t)
        lens.append(n)
        ctxs.append(cached + n)
        for pos in range(cached, cached + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        (decode if n == 1 else prefill).append(i)
        t += n
    width = max(len(c[2]) for c in chunks)
    tables = torch.tensor([c[2] + [0] * (width - len(c[2])) for c in chunks])
    return PagedBatch(
        slot_mapping=torch.tensor(slots), q_start=starts, q_len=lens, context_lens=ctxs, block_tables=tables,
        block_size=block_size, decode_rows=torch.tensor(decode, dtype=torch.long), prefill_rows=prefill,
        decode_context_lens=torch.tensor([ctxs[i] for i in decode], dtype=torch.long),
    )  # fmt: skip


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_paged_forward_equals_whole_sequence(case, tmp_path):
    """Three sequences: one prefilled in two chunks, then all decoded together in one batch."""
    _, ours = tiny_pair(case, tmp_path)
    bs = 4
    attach_cache(ours, num_blocks=32, block_size=bs)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (13, 6, 9)]
    tables = [[5, 1, 7, 3], [2, 9], [11, 4, 8]]
    with torch.no_grad():
        # step 1: seq 0 first chunk (8), seq 1 whole prompt minus last token (5), seq 2 whole prompt but last (8)
        plan = [(0, 8, 0), (1, 5, 0), (2, 8, 0)]
        # step 2: seq 0 rest (5 tokens after 8 cached), seqs 1 and 2 one token each (decode path)
        plan2 = [(0, 5, 8), (1, 1, 5), (2, 1, 8)]
        for step in (plan, plan2):
            ids = torch.tensor([t for i, n, c in step for t in seqs[i][c : c + n]])
            pos = torch.tensor([p for i, n, c in step for p in range(c, c + n)])
            batch = paged_batch([(c, n, tables[i]) for i, n, c in step], bs)
            hidden = ours(ids, pos, batch)
        last = [sum(n for _, n, _ in plan2[: j + 1]) - 1 for j in range(3)]
        got = ours.compute_logits(hidden[last])
        for j, s in enumerate(seqs):
            want = ours.compute_logits(ours(torch.tensor([s])))[0, -1]
            assert (got[j] - want).abs().max().item() < 1e-4 * want.abs().max().item()


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
