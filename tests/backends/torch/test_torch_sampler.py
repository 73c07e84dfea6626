"""The torch backend's batched sampler: llama.cpp's chain (checked against llama.cpp's own samplers where it
is deterministic), seeded reproducibility independent of the batch, raw logprobs, and the sampled distribution."""

from __future__ import annotations

import ctypes
import math
import zlib

import numpy as np
import pytest
import torch

from quantserve.backends.torch.sampler import Sampler, apply_penalties, filter_threshold, min_p_threshold
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.errors import InvalidRequestError

V = 64


def seq(rid: str, prompt: list[int] | None = None, **params) -> Sequence:
    return Sequence(rid, prompt or [1, 2, 3], SamplingParams(**params), IncrementalDetokenizer(), 4096)


def step_logits(rid: str, step: int, vocab: int = V) -> torch.Tensor:
    """The same logits for a given sequence and step, whatever batch it is in."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{step}".encode()))
    return torch.randn(vocab, generator=g) * 2


def run(sampler: Sampler, seqs: list[Sequence], steps: int, vocab: int = V) -> dict[str, list[int]]:
    """Decode `steps` tokens for every sequence in one batch, appending each sampled token."""
    for step in range(steps):
        logits = torch.stack([step_logits(s.request_id, step, vocab) for s in seqs]).to(sampler.device)
        for s, out in zip(seqs, sampler.sample(logits, seqs), strict=True):
            s.tokens.append(out.token)
    return {s.request_id: s.output_tokens for s in seqs}


def llama_survivors(samplers: list, logits: np.ndarray, accepted: list[int] = ()) -> dict[int, float]:
    """Apply a llama.cpp sampler chain (no final draw) to one row; the surviving ids and their logits."""
    lc = pytest.importorskip("llama_cpp")
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for smpl in samplers:
        lc.llama_sampler_chain_add(chain, smpl)
    for t in accepted:
        lc.llama_sampler_accept(chain, t)
    arr = (lc.llama_token_data * len(logits))()
    for i, v in enumerate(logits):
        arr[i].id, arr[i].logit, arr[i].p = i, float(v), 0.0
    cur = lc.llama_token_data_array(arr, len(logits), -1, False)
    lc.llama_sampler_apply(chain, ctypes.byref(cur))
    out = {arr[i].id: arr[i].logit for i in range(cur.size)}
    lc.llama_sampler_free(chain)
    return out


# ---- greedy and its limits --------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    seqs = [seq(f"g{i}", temperature=0.0) for i in range(5)]
    assert [t.token for t in Sampler().sample(logits, seqs)] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"temperature": 1e-4}])
def test_filters_at_their_limit_are_greedy(params):
    sampler = Sampler()
    params = {"temperature": 1.5, **params}
    seqs = [seq(f"s{i}", seed=i, **params) for i in range(8)]
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        assert [t.token for t in sampler.sample(logits, seqs)] == logits.argmax(-1).tolist()


# ---- seeds ------------------------------------------------------------------------------------------


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])])
def test_seeded_sampling_is_reproducible_and_batch_independent(device):
    target = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}

    def target_tokens(seqs: list[Sequence]) -> list[int]:
        return run(Sampler(device), seqs, 30, vocab=1000)["a"]

    alone = target_tokens([seq("a", **target)])
    others = [
        seq("b", temperature=0.0),
        seq("c", temperature=1.2, top_k=5, repeat_penalty=1.2, logprobs=True, top_logprobs=3),
        seq("d", temperature=0.7, min_p=0.1, logit_bias=((3, 2.0),)),
        seq("e", temperature=1.0),  # unseeded
    ]
    batched = target_tokens([others[0], others[1], seq("a", **target), *others[2:]])
    assert alone == batched == target_tokens([seq("a", **target)])
    assert len(set(alone)) > 5  # it really sampled
    assert target_tokens([seq("a", **{**target, "seed": 99})]) != alone


def test_state_lives_until_removed():
    sampler = Sampler()
    s = seq("r", temperature=1.0, seed=7)
    logits = step_logits("r", 0)[None]
    first = [sampler.sample(logits, [s])[0].token for _ in range(20)]
    assert len(sampler) == 1 and len(set(first)) > 1  # one stream, advancing
    sampler.remove(s)
    sampler.remove(s)  # idempotent
    assert len(sampler) == 0
    assert [sampler.sample(logits, [s])[0].token for _ in range(20)] == first  # fresh generator, same seed


def test_unseeded_sequences_get_different_streams():
    logits = torch.zeros(2, 1000)  # uniform
    sampler = Sampler()
    seqs = [seq("u1", temperature=1.0), seq("u2", temperature=1.0)]
    draws = [sampler.sample(logits, seqs) for _ in range(5)]
    assert [d[0].token for d in draws] != [d[1].token for d in draws]


# ---- filters, against llama.cpp's own samplers ----------------------------------------------------------


def survivors(x: torch.Tensor, top_k: list[int], top_p: list[float], mp: list[float]) -> torch.Tensor:
    thr = torch.maximum(filter_threshold(x, top_k, top_p), min_p_threshold(x, mp))
    return x >= thr[:, None]


@pytest.mark.parametrize(
    "k,p,mp", [(0, 0.9, 0.0), (10, 1.0, 0.0), (20, 0.7, 0.05), (0, 1.0, 0.2), (5, 0.5, 0.3)]
)
@pytest.mark.parametrize(
    "vocab", [500, 3000]
)  # 3000: top-p alone may need more than the first 256 candidates
def test_top_k_top_p_min_p_keep_what_llama_cpp_keeps(k, p, mp, vocab):
    lc = pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(k * 100 + int(p * 10) + vocab)
    x = (rng.standard_normal((6, vocab)) * np.array([[0.3], [1], [2], [3], [5], [8]])).astype(np.float32)
    kept = survivors(torch.from_numpy(x), [k] * 6, [p] * 6, [mp] * 6)
    for row in range(6):
        ref = llama_survivors(
            [
                lc.llama_sampler_init_top_k(k),
                lc.llama_sampler_init_top_p(p, 1),
                lc.llama_sampler_init_min_p(mp, 1),
            ],
            x[row],
        )
        assert kept[row].nonzero().flatten().tolist() == sorted(ref)


def test_filter_rows_are_independent_and_ties_are_kept():
    x = torch.randn(4, 2000, generator=torch.Generator().manual_seed(4))
    x[3] = x[3] * 0.01  # flat: top-p 0.9 needs far more than 256 candidates
    k, p = [0, 40, 0, 0], [0.8, 1.0, 1.0, 0.9]
    together = filter_threshold(x, k, p)
    alone = torch.cat([filter_threshold(x[i : i + 1], k[i : i + 1], p[i : i + 1]) for i in range(4)])
    assert torch.equal(together, alone)
    assert together[2] == -math.inf and (x[1] >= together[1]).sum() == 40
    assert (x[3] >= together[3]).sum() > 1000
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert (tied >= filter_threshold(tied, [2], [1.0])[:, None]).tolist() == [
        [True, False, True, True, False]
    ]


def test_min_p_filter_by_hand():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert (x >= min_p_threshold(x, [0.2])[:, None]).tolist() == [
        [True, True, True, False]
    ]  # 0.05 < 0.2 * 0.5
    assert (x >= min_p_threshold(x, [0.0])[:, None]).all()


# ---- penalties and bias ------------------------------------------------------------------------------


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, -2.0]])
    s = seq("p", prompt=[0, 0, 0, 0], temperature=0.0, repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
            penalty_last_n=4)  # fmt: skip
    s.tokens += [
        5,
        1,
        3,
        1,
        1,
        2,
    ]  # generated; the window is the last 4: 3, 1, 1, 2 (prompt tokens never count)
    expected = [
        2.0,  # token 0: only in the prompt
        -1.0 * 2.0 - (2 * 0.5 + 0.25),  # seen twice, negative: multiplied
        0.5 / 2.0 - (0.5 + 0.25),
        3.0 / 2.0 - (0.5 + 0.25),
        0.0,
        -2.0,  # token 5 left the window
    ]
    got = logits.clone()
    apply_penalties(got, [0], [s.tokens[-4:]], [s.params])
    assert got[0].tolist() == pytest.approx(expected)
    # the sampler picks its window the same way: greedy on these logits picks token 0 (3.0 fell to 0.75)
    assert Sampler().sample(logits, [s])[0].token == 0


def test_penalties_equal_llama_cpp_bit_for_bit():
    lc = pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(V) * 3).astype(np.float32)
    generated = [int(t) for t in rng.integers(0, 12, 40)]
    p = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=-0.4, penalty_last_n=16)
    ref = llama_survivors([lc.llama_sampler_init_penalties(V, 16, 1.3, 0.2, -0.4)], x, generated)
    ours = torch.from_numpy(np.stack([x, x]))
    apply_penalties(ours, [1], [generated[-16:]], [p])  # row 1 only
    assert torch.equal(ours[1], torch.tensor([ref[i] for i in range(V)]))
    assert torch.equal(ours[0], torch.from_numpy(x))


def test_penalty_window_disabled_cases():
    logits = torch.tensor([[1.0, 0.9]])
    for params in (
        {"penalty_last_n": 0, "repeat_penalty": 5.0},
        {"penalty_last_n": -1, "repeat_penalty": 5.0},
    ):
        s = seq("w", temperature=0.0, **params)
        s.tokens.append(0)
        assert Sampler().sample(logits, [s])[0].token == 0  # no penalty applied


def test_logit_bias():
    logits = torch.zeros(2, V)
    logits[:, 7] = 5.0
    seqs = [
        seq("b1", temperature=0.0, logit_bias=((9, 10.0),)),
        seq("b2", temperature=0.0, logit_bias=((7, -100.0),)),
    ]
    out = Sampler().sample(logits, seqs)
    assert out[0].token == 9 and out[1].token != 7
    # duplicate entries add up, as llama.cpp applies each one
    s = seq("b3", temperature=0.0, logit_bias=((4, 3.0), (4, 3.0)))
    assert Sampler().sample(logits[:1], [s])[0].token == 4


def test_bad_bias_is_rejected():
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \(0..63\)") as e:
        Sampler(n_vocab=V).add(seq("y", logit_bias=((64, 1.0),)))
    assert e.value.param == "logit_bias"


# ---- grammars -----------------------------------------------------------------------------------------

# A 64-token vocabulary: 0 is an end-of-generation control token, 1..10 the digits, the rest letters and marks.
PIECES = (
    [b"</s>"] + [str(d).encode() for d in range(10)] + [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz"]
)
PIECES += [bytes([c]) for c in b'{}[]:," ']
PIECES += [f"w{i}".encode() for i in range(V - len(PIECES))]


def tiny_guides():
    from quantserve.structured import GuideCompiler, Vocabulary

    table = {p.decode(): i for i, p in enumerate(PIECES)}

    def tokenize(text: str) -> list[int]:  # one token per character is enough for llguidance here
        return [table[c] for c in text]

    return GuideCompiler(Vocabulary(PIECES, frozenset({0}), (0,), tokenize), V)


def test_grammar_mask_is_applied_per_row_and_the_rest_of_the_batch_is_untouched():
    """A regex grammar for 3-digit numbers on row 0 only: its greedy choice is the best digit, then EOS once the
    number is complete; row 1 (no grammar) still takes its own argmax, a letter."""
    from quantserve.structured import lark_grammar

    guides = tiny_guides()
    s0, s1 = seq("g", temperature=0.0), seq("free", temperature=0.0)
    s0.guide = guides.guide(lark_grammar("start: /[0-9]{3}/", param="response_format"))
    sampler = Sampler()
    for step in range(4):
        logits = torch.zeros(2, V)
        logits[:, 15] = 9.0  # a letter is the model's favourite
        logits[:, 1 + (step * 3) % 10] = 5.0  # then some digit
        out = sampler.sample(logits, [s0, s1])
        assert out[1].token == 15
        if step < 3:
            assert out[0].token == 1 + (step * 3) % 10
            assert s0.guide.accept(out[0].token)
        else:
            assert out[0].token == 0  # complete: only the end-of-generation token is left


def test_torch_mask_equals_the_numpy_reference():
    from quantserve.backends.torch.sampler import apply_token_masks
    from quantserve.structured import apply_mask

    rng = np.random.default_rng(0)
    masks = rng.integers(-(2**31), 2**31, size=(3, 2), dtype=np.int64).astype(np.int32)
    x = torch.randn(4, V)
    want = x.numpy().copy()
    for row, m in zip([0, 2, 3], masks, strict=True):
        apply_mask(want[row], m)
    apply_token_masks(x, [0, 2, 3], masks)
    assert np.array_equal(x.numpy(), want)


# ---- logprobs ----------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)) * 3
    seqs = [
        seq("l1", temperature=0.0, logprobs=True, top_logprobs=5),
        seq(
            "l2", temperature=0.6, top_k=8, seed=1, logprobs=True, repeat_penalty=1.5, logit_bias=((2, 4.0),)
        ),
        seq("l3", temperature=0.0),
    ]
    seqs[1].tokens += [2, 5, 9]
    out = Sampler().sample(logits, seqs)
    lsm = torch.log_softmax(logits, -1)
    for row in (0, 1):
        lp = out[row].logprob
        assert lp.token == out[row].token
        assert lp.logprob == pytest.approx(lsm[row, lp.token].item(), abs=1e-6)
    top = out[0].logprob.top
    assert [t for t, _ in top] == lsm[0].topk(5).indices.tolist()
    assert [v for _, v in top] == pytest.approx(lsm[0].topk(5).values.tolist(), abs=1e-6)
    assert top[0][0] == out[0].token  # greedy: the best token
    assert out[1].logprob.top == () and out[2].logprob is None


# ---- the distribution --------------------------------------------------------------------------------


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("params", [{"temperature": 0.7}, {"temperature": 1.3, "top_k": 3}, {"min_p": 0.3}])
def test_sampling_matches_the_softmax(params):
    x = torch.tensor([1.0, 0.5, -0.3, 0.2])
    n = 4000
    seqs = [seq(f"d{i}", seed=i, **params) for i in range(n)]
    tokens = [t.token for t in Sampler().sample(x.expand(n, 4), seqs)]
    counts = [tokens.count(i) for i in range(4)]
    z = x.clone()
    if params.get("top_k"):
        z[z.argsort(descending=True)[params["top_k"] :]] = -math.inf
    if params.get("min_p"):
        z[z < z.max() + math.log(params["min_p"])] = -math.inf
    probs = torch.softmax(z / params.get("temperature", 1.0), -1).tolist()
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)  # filtered tokens never drawn
    dof = sum(p > 0 for p in probs) - 1
    assert chi_square(counts, probs) < {1: 10.8, 2: 13.8, 3: 16.3}[dof]  # p = 0.001
