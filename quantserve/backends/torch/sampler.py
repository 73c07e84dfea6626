"""Batched sampling for the torch backend: one token per row of a [B, V] logits tensor, llama.cpp's chain.

Each row follows the chain the llama.cpp backend builds (backends/llamacpp/sampler.py, llama.cpp
src/llama-sampler.cpp): logit bias → penalties → grammar mask → (greedy argmax) or top-k → top-p → min-p →
temperature → draw.
Penalties count the sequence's last `penalty_last_n` *generated* tokens, as llama.cpp's penalties sampler only
sees the tokens its chain accepted. Logprobs are those of the model's raw distribution (log-softmax of the
logits before any of the chain), as the llama.cpp runner reports them.

A seeded request is reproducible whatever batch it runs in: every row's math is row-local, and its draw is one
uniform number from its own generator (kept for the sequence's life), turned into a token by inverse CDF over
the vocabulary in id order — the way llama.cpp's dist sampler draws, over a fixed candidate order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import SampledToken, Sequence, TokenLogprob
from quantserve.errors import InvalidRequestError
from quantserve.structured import fill_masks


def check_params(params: SamplingParams, n_vocab: int | None = None) -> None:
    """Reject what the torch sampler cannot do, before the request is queued.

    Raises:
        InvalidRequestError: a logit_bias token outside the vocabulary.
    """
    if n_vocab is not None:
        for tok, _ in params.logit_bias:
            if not 0 <= tok < n_vocab:
                raise InvalidRequestError(
                    f"logit_bias token id {tok} is outside the vocabulary (0..{n_vocab - 1})",
                    param="logit_bias",
                )


def penalized(p: SamplingParams) -> bool:
    # llama.cpp clamps penalty_last_n to >= 0 and skips the sampler when it is 0 or every penalty is neutral
    return p.penalty_last_n > 0 and (
        p.repeat_penalty != 1.0 or p.frequency_penalty != 0 or p.presence_penalty != 0
    )


def apply_logit_bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    """x [B, V] += each row's logit_bias, in place. Ids outside the vocabulary are skipped, as llama.cpp does."""
    entries = [
        (i, tok, bias) for i, p in enumerate(params) for tok, bias in p.logit_bias if 0 <= tok < x.shape[1]
    ]
    if entries:
        rows, cols, vals = zip(*entries, strict=True)
        idx = (torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device))
        x.index_put_(idx, torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)


def apply_penalties(
    x: torch.Tensor, rows: list[int], windows: list[list[int]], params: list[SamplingParams]
) -> None:
    """llama.cpp's penalties sampler, in place on the given rows of x [B, V]: a token seen c > 0 times in its
    row's (non-empty) window has its logit divided by repeat_penalty if positive (multiplied if not), then
    lowered by c * frequency_penalty + presence_penalty. Only the [R, window] entries are touched."""
    dev = x.device
    width = max(len(w) for w in windows)
    # pad each window by repeating its first token; pads count 0 and rewrite an entry with its own new value
    ids = torch.tensor([w + w[:1] * (width - len(w)) for w in windows], device=dev)  # [R, W]
    real = torch.tensor([[1.0] * len(w) + [0.0] * (width - len(w)) for w in windows], device=dev)
    r = torch.tensor(rows, device=dev)[:, None]
    counts = torch.zeros(len(rows), x.shape[1], device=dev).scatter_add_(1, ids, real).gather(1, ids)
    rep, freq, pres = torch.tensor(
        [[p.repeat_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
        dtype=x.dtype,
        device=dev,
    )[:, :, None].unbind(1)
    v = x[r, ids]
    v = torch.where(v <= 0, v * rep, v / rep) - (counts * freq + pres)  # llama.cpp: c * freq + (c > 0) * pres
    x[r, ids] = v


def apply_token_masks(x: torch.Tensor, rows: list[int], masks: np.ndarray) -> None:
    """Grammar masks (quantserve.structured: int32 [R, ceil(V / 32)], bit j of word i is token 32 i + j) on the
    given rows of x [B, V], in place: forbidden tokens get -inf."""
    m = torch.from_numpy(masks).to(x.device)
    bits = (m[:, :, None] >> torch.arange(32, dtype=torch.int32, device=x.device)) & 1  # [R, W, 32]
    forbidden = bits.reshape(len(rows), -1)[:, : x.shape[1]] == 0
    r = torch.tensor(rows, device=x.device)
    x[r] = x[r].masked_fill(forbidden, float("-inf"))


# llama.cpp's top-p first looks for its cut among the best 256 tokens and sorts everything only when the mass
# there falls short (llama_sampler_top_p_apply); the same here, per row.
TOP_P_CANDIDATES = 256


def filter_threshold(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The logit [R] below which llama.cpp's top-k then top-p drop a token, for each row of x [R, V].

    top_k: keep the k best (0 = off); top_p: then keep the shortest best-first run whose softmax mass (over
    what top-k kept) reaches p, the crossing token included (1 = off). Cuts are made by value, so tokens tied
    with the last kept one are kept too (llama.cpp keeps an arbitrary k of them): the result never depends on
    how a kernel orders equal values, which keeps seeded sampling independent of the batch.
    """
    V = x.shape[1]
    ks = [k if 0 < k < V else V for k in top_k]
    ps = [p if p < 1.0 else math.inf for p in top_p]
    n = min(V, max([TOP_P_CANDIDATES] + [k for k in ks if k < V]))
    thr, last = _cut(x, x.topk(n, dim=-1).values, ks, ps)
    if n < V:
        # rows with top-k off whose top-p mass the candidates did not reach
        short = [i for i, j in enumerate(last.tolist()) if ks[i] == V and ps[i] < math.inf and j >= n]
        if short:
            sub = x[short]
            thr[short] = _cut(
                sub, sub.sort(dim=-1, descending=True).values, [V] * len(short), [ps[i] for i in short]
            )[0]
    return thr


def _cut(
    x: torch.Tensor, vals: torch.Tensor, ks: list[int], ps: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold [R] and position [R] of the last kept token, from each row's best values vals [R, n] (sorted,
    descending). A position >= n means the cut lies beyond the candidates."""
    n = vals.shape[1]
    dev = x.device
    k = torch.tensor(ks, device=dev)
    kept = vals.masked_fill(torch.arange(n, device=dev) >= k[:, None], float("-inf"))
    m = vals[:, :1]
    e = torch.exp(kept - m)
    z = torch.where(k[:, None] < x.shape[1], e.sum(-1, keepdim=True), torch.exp(x - m).sum(-1, keepdim=True))
    crossed = (e / z).cumsum(-1) >= torch.tensor(ps, dtype=vals.dtype, device=dev)[:, None]
    first = torch.where(crossed.any(-1), crossed.int().argmax(-1), x.shape[1])  # first position reaching p
    last = torch.minimum(first, k - 1)
    thr = vals.gather(1, last.clamp(max=n - 1)[:, None]).squeeze(1)
    return torch.where(last >= x.shape[1] - 1, float("-inf"), thr), last  # keeping all needs no threshold


def min_p_threshold(x: torch.Tensor, p: list[float]) -> torch.Tensor:
    """llama.cpp's min-p as a logit threshold [R]: tokens less likely than p times the best one, i.e. with
    logits below max + log(p), are dropped (p = 0 keeps everything)."""
    return x.amax(-1) + torch.log(torch.tensor(p, dtype=x.dtype, device=x.device))


def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of x [R, V] from softmax(x), by inverse CDF with uniforms u [R] in [0, 1).

    llama.cpp's dist sampler: p = exp(x - max) in fp32 summed in fp64, first token whose running sum passes
    u * total. Searching for the first sum strictly above the target never lands on a masked (p = 0) token."""
    e = torch.exp(x - x.amax(-1, keepdim=True)).double()
    cdf = e.cumsum(-1)
    target = cdf[:, -1:] * u[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)


@dataclass
class _SeqState:
    params: SamplingParams
    generator: torch.Generator  # CPU: one scalar per step, so seeded output does not depend on the device


class Sampler:
    """Per-sequence sampling state plus the batched chain. Not thread-safe (the engine thread owns it).

    Args:
        device: where the chain runs; logits arriving elsewhere are moved there first.
        n_vocab: when given, `add` rejects logit_bias ids outside the vocabulary.
    """

    def __init__(self, device: torch.device | str = "cpu", n_vocab: int | None = None):
        self.device = torch.device(device)
        self.n_vocab = n_vocab
        self._states: dict[int, _SeqState] = {}  # Sequence.seq_id -> state

    def __len__(self) -> int:
        return len(self._states)

    def add(self, seq: Sequence) -> None:
        """Validate the sequence's params and seed its generator (a seedless request gets a random seed).
        Called by `sample` for a sequence it has not seen; call it earlier to fail a bad request up front.

        Raises:
            InvalidRequestError: see `check_params`.
        """
        p = seq.params
        check_params(p, self.n_vocab)
        seed = p.seed if p.seed is not None else random.getrandbits(63)
        gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self._states[seq.seq_id] = _SeqState(p, gen)

    def remove(self, seq: Sequence) -> None:
        """Forget the sequence (idempotent). A preempted sequence that will recompute keeps its state instead,
        so its random stream continues where it stopped."""
        self._states.pop(seq.seq_id, None)

    def _state(self, seq: Sequence) -> _SeqState:
        st = self._states.get(seq.seq_id)
        if st is None:
            self.add(seq)
            st = self._states[seq.seq_id]
        return st

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """Sample the next token of each sequence from its row of logits [B, V] (fp32)."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (tuple(logits.shape), len(seqs))
        states = [self._state(s) for s in seqs]
        params = [st.params for st in states]
        logits = logits.to(self.device, torch.float32)
        pen = [
            i
            for i, (p, s) in enumerate(zip(params, seqs, strict=True))
            if penalized(p) and s.num_output_tokens
        ]
        x = logits
        if pen or any(p.logit_bias for p in params):
            x = logits.clone()  # the raw logits stay intact for logprobs
            apply_logit_bias(x, params)
        if pen:
            windows = [_penalty_window(seqs[i], params[i].penalty_last_n) for i in pen]
            apply_penalties(x, pen, windows, [params[i] for i in pen])
        guided = [i for i, s in enumerate(seqs) if s.guide is not None]
        if guided:  # after the penalties, where llama.cpp's chain has its grammar
            if x is logits:
                x = logits.clone()
            masks = np.empty((len(guided), (x.shape[1] + 31) // 32), dtype=np.int32)
            fill_masks([seqs[i].guide for i in guided], masks)
            apply_token_masks(x, guided, masks)
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if not rand:
            tokens = x.argmax(-1)
        else:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=x.device)
            greedy = [i for i, p in enumerate(params) if p.greedy]
            if greedy:
                tokens[greedy] = x[greedy].argmax(-1)
            tokens[rand] = self._sample_random(x[rand], [states[i] for i in rand])
        token_list: list[int] = tokens.tolist()
        lp_rows = [i for i, p in enumerate(params) if p.logprobs]
        lps = _logprobs(logits, lp_rows, token_list, [params[i] for i in lp_rows]) if lp_rows else {}
        return [SampledToken(t, lps.get(i)) for i, t in enumerate(token_list)]

    def _sample_random(self, x: torch.Tensor, states: list[_SeqState]) -> torch.Tensor:
        """top-k → top-p → min-p → temperature → draw, on the non-greedy rows x [R, V]."""
        params = [st.params for st in states]
        thr = torch.full((len(params),), float("-inf"), device=x.device)
        filt = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if filt:
            thr[filt] = filter_threshold(
                x[filt], [params[j].top_k for j in filt], [params[j].top_p for j in filt]
            )
        if any(p.min_p > 0 for p in params):
            thr = torch.maximum(thr, min_p_threshold(x, [p.min_p for p in params]))
        if filt or any(p.min_p > 0 for p in params):
            x = x.masked_fill(x < thr[:, None], float("-inf"))
        x = x / torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)[:, None]
        u = [torch.rand((), dtype=torch.float64, generator=st.generator).item() for st in states]
        return draw(x, torch.tensor(u, dtype=torch.float64, device=x.device))


def _penalty_window(seq: Sequence, last_n: int) -> list[int]:
    """The generated tokens llama.cpp's penalties sampler would hold: the last `last_n` sampled ones."""
    return seq.tokens[max(seq.num_prompt_tokens, len(seq.tokens) - last_n) :]


def _logprobs(
    logits: torch.Tensor, rows: list[int], tokens: list[int], params: list[SamplingParams]
) -> dict[int, TokenLogprob]:
    """Raw log-softmax logprob of each chosen token, its row's top_logprobs best tokens and its logprob_tokens,
    for the given rows."""
    lsm = torch.log_softmax(logits[rows], dim=-1)
    chosen = [tokens[i] for i in rows]
    chosen_lp = lsm.gather(1, torch.tensor(chosen, device=lsm.device)[:, None]).squeeze(1).tolist()
    tops = [p.top_logprobs for p in params]
    n = max(tops)
    top_v, top_i = lsm.topk(n, dim=-1) if n else (lsm[:, :0], lsm[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out = {}
    for j, i in enumerate(rows):
        asked = tuple(lsm[j, list(params[j].logprob_tokens)].tolist()) if params[j].logprob_tokens else ()
        top = tuple(zip(top_i[j][: tops[j]], top_v[j][: tops[j]], strict=True))
        out[i] = TokenLogprob(chosen[j], chosen_lp[j], top, asked)
    return out
