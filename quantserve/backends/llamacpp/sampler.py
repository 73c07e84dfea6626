"""Builds a llama.cpp sampler chain for one sequence from its SamplingParams."""

from __future__ import annotations

import random

import llama_cpp as lc
import numpy as np

from quantserve.core.sampling_params import SamplingParams
from quantserve.errors import InvalidRequestError


class SamplerChain:
    """Owns one `llama_sampler` chain. Order follows llama.cpp's common sampler:
    logit bias → penalties → top-k → top-p → min-p → temperature → dist (or greedy). A grammar is not in the chain:
    the runner masks the logits with the sequence's Guide (quantserve.structured) before the chain sees them,
    which puts it where llama.cpp's grammar sampler would be, after the penalties (-inf stays -inf through them)."""

    def __init__(self, vocab: lc.llama_vocab_p, n_vocab: int, params: SamplingParams):
        cparams = lc.llama_sampler_chain_default_params()
        cparams.no_perf = True
        self.ptr = lc.llama_sampler_chain_init(cparams)
        self.n_vocab = n_vocab
        self.plain_greedy = False  # greedy with nothing before it in the chain (set by _build)
        try:
            self._build(vocab, n_vocab, params)
        except BaseException:
            self.close()
            raise

    def _add(self, smpl) -> None:
        lc.llama_sampler_chain_add(self.ptr, smpl)  # the chain takes ownership

    def _build(self, vocab, n_vocab: int, p: SamplingParams) -> None:
        if p.logit_bias:
            arr = (lc.llama_logit_bias * len(p.logit_bias))()
            for i, (tok, bias) in enumerate(p.logit_bias):
                if not 0 <= tok < n_vocab:
                    raise InvalidRequestError(
                        f"logit_bias token id {tok} is outside the vocabulary (0..{n_vocab - 1})",
                        param="logit_bias",
                    )
                arr[i].token, arr[i].bias = tok, bias
            self._add(lc.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), arr))
        if p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            self._add(
                lc.llama_sampler_init_penalties(
                    n_vocab, p.penalty_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
                )
            )
        if p.greedy:
            # Plain greedy is an argmax, which numpy does in 3 us; llama.cpp's chain first copies the vocabulary
            # into a candidate array (38 us for SmolLM2's 49k tokens), on every token of every sequence.
            self.plain_greedy = lc.llama_sampler_chain_n(self.ptr) == 0
            self._add(lc.llama_sampler_init_greedy())
            return
        if p.top_k > 0:
            self._add(lc.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            self._add(lc.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            self._add(lc.llama_sampler_init_min_p(p.min_p, 1))
        self._add(lc.llama_sampler_init_temp(p.temperature))
        seed = p.seed if p.seed is not None else random.getrandbits(32)
        self._add(lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def sample(self, ctx, idx: int) -> int:
        """Sample from the logits of batch output `idx`; also accepts the token into the chain's state."""
        if self.plain_greedy:  # the first maximum, as llama.cpp's greedy sampler picks it
            return int(
                np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, idx), shape=(self.n_vocab,)).argmax()
            )
        return lc.llama_sampler_sample(self.ptr, ctx, idx)

    def close(self) -> None:
        if self.ptr:
            lc.llama_sampler_free(self.ptr)
            self.ptr = None
