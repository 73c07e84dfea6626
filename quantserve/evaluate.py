"""Quality metrics: perplexity (llama-perplexity's convention) and KL divergence between two models, scored by
llama.cpp or by quantserve's own torch model on the same chunks of the same tokens (what a conversion cost is
measured with these in conversion_quality.py). Each model is loaded by its backend's own loader, and scored by its
runner (`score`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantserve.errors import ConfigError, InvalidRequestError, require_torch

log = logging.getLogger("quantserve.evaluate")


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token
    n_chunks: int
    n_scored: int
    n_ctx: int
    scored_by: str = "llama.cpp"  # the scorer: "llama.cpp", or "torch (DEVICE, DTYPE)"


@dataclass(frozen=True)
class KLResult:
    mean_kl: float  # mean over scored tokens of KL(base || model), in nats
    top1_agreement: float  # fraction of scored tokens where both models' argmax agree
    ppl_base: float
    ppl_model: float
    n_scored: int
    scored_by: str = "llama.cpp"


class Scorer:
    """One model loaded by its backend's own plan and loader (quantserve.backends), as `quantserve run` would load
    it, with a context of one chunk: its runner tokenizes the text and scores each chunk.

    Chunks follow llama-perplexity: text split into n_ctx-token chunks, the first token of each replaced by BOS
    when the vocabulary adds one, and only the second half of each chunk scored (so every scored token has at
    least n_ctx/2 tokens of context).

    Raises:
        ConfigError: an unknown backend. Whatever planning or loading the model raises (a GGUF for the torch
        backend, a malformed file).
    """

    def __init__(self, path: Path, backend: str = "llamacpp", *, n_ctx: int = 512, threads: int = 0):
        from quantserve.backends.select import BACKENDS, plan_model
        from quantserve.core.settings import EngineSettings
        from quantserve.formats import detect

        if backend not in BACKENDS:
            raise ConfigError(f"unknown scoring backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if backend == "torch":
            require_torch("scoring with --backend torch")
        settings = EngineSettings.from_options(
            backend=backend, ctx_size=n_ctx, n_batch=n_ctx, max_num_seqs=1, threads=threads, prefix_cache=False,
            flash_attn="off", kv_fill_gpu=False, cuda_graphs=False,
        )  # fmt: skip
        plan = plan_model(detect(path), settings)
        self.loaded = BACKENDS[plan.backend].load(plan)
        self.runner = self.loaded.runner
        self.n_ctx, self.n_vocab, self.scored_by = n_ctx, self.runner.n_vocab, self.runner.scored_by

    def tokenize(self, text: str) -> list[int]:
        return self.runner.tokenize(text, add_special=True, parse_special=False)

    def chunks(self, tokens: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (log-probs [n_ctx/2 - 1, vocab] of the scored positions, their target tokens) per chunk."""
        n, first = self.n_ctx, self.n_ctx // 2
        bos = self.runner.bos_token if self.runner.adds_bos() else None
        for start in range(0, len(tokens) - n + 1, n):
            chunk = list(tokens[start : start + n])
            if bos is not None and bos >= 0:
                chunk[0] = bos
            yield self.runner.score(chunk, first), np.asarray(chunk[first + 1 : n])

    def close(self) -> None:
        self.runner.close()
        if self.loaded.keep_alive is not None:
            self.loaded.keep_alive.cleanup()


def _tokens(scorer: Scorer, text: str) -> list[int]:
    tokens = scorer.tokenize(text)
    if len(tokens) < 2 * scorer.n_ctx:
        raise InvalidRequestError(
            f"the text has {len(tokens)} tokens; perplexity needs at least {2 * scorer.n_ctx} (2 x n_ctx "
            f"{scorer.n_ctx}): give a longer --text, or a smaller --ctx"
        )
    return tokens


def perplexity(
    path: Path, text: str, *, n_ctx: int = 512, threads: int = 0, progress=None, backend: str = "llamacpp"
) -> PerplexityResult:
    scorer = Scorer(path, backend, n_ctx=n_ctx, threads=threads)
    try:
        tokens = _tokens(scorer, text)
        nll, count, chunks = 0.0, 0, 0
        for logp, targets in scorer.chunks(tokens):
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            count += len(targets)
            chunks += 1
            if progress:
                progress(chunks, len(tokens) // n_ctx)
    finally:
        scorer.close()
    return PerplexityResult(math.exp(nll / count), nll / count, chunks, count, n_ctx, scorer.scored_by)


def kl_divergence(
    base: Path,
    model: Path,
    text: str,
    *,
    n_ctx: int = 512,
    threads: int = 0,
    progress=None,
    backend: str = "llamacpp",
) -> KLResult:
    """KL(base || model) per scored token, over the same chunks, plus both perplexities and top-1 agreement.
    Both models are scored by `backend`."""
    (result,) = kl_divergences(
        base, [model], text, n_ctx=n_ctx, threads=threads, progress=progress, backend=backend
    )
    return result


def kl_divergences(
    base: Path,
    models: Sequence[Path],
    text: str,
    *,
    n_ctx: int = 512,
    threads: int = 0,
    progress=None,
    backend: str = "llamacpp",
) -> list[KLResult]:
    """kl_divergence of each model against one base, which is scored once: all the models are loaded at once and
    each chunk is scored by the base, then by each model (llama-perplexity instead saves the base's logits to a
    file, --kl-divergence-base)."""
    scorers: list[Scorer] = []
    try:
        for path in (base, *models):
            scorers.append(Scorer(path, backend, n_ctx=n_ctx, threads=threads))
        a, others = scorers[0], scorers[1:]
        tokens = _tokens(a, text)
        for b in others:
            if a.n_vocab != b.n_vocab:
                raise ConfigError(
                    f"vocabularies differ ({a.n_vocab} vs {b.n_vocab} tokens); KL needs the same vocab"
                )
            if b.tokenize(text) != tokens:
                raise ConfigError("the two models tokenize the text differently; KL needs the same tokenizer")
        kl = [0.0] * len(others)
        nll_b = [0.0] * len(others)
        agree = [0] * len(others)
        nll_a, count = 0.0, 0
        streams = zip(a.chunks(tokens), *(b.chunks(tokens) for b in others), strict=True)
        for done, ((lp, targets), *scored) in enumerate(streams, start=1):
            rows = np.arange(len(targets))
            p, top = np.exp(lp), lp.argmax(-1)
            for i, (lq, _) in enumerate(scored):
                kl[i] += float((p * (lp - lq)).sum())
                agree[i] += int((top == lq.argmax(-1)).sum())
                nll_b[i] -= float(lq[rows, targets].sum())
            nll_a -= float(lp[rows, targets].sum())
            count += len(targets)
            if progress:
                progress(done, len(tokens) // n_ctx)
    finally:
        for scorer in scorers:
            scorer.close()
    return [
        KLResult(
            kl[i] / count,
            agree[i] / count,
            math.exp(nll_a / count),
            math.exp(nll_b[i] / count),
            count,
            a.scored_by,
        )  # fmt: skip
        for i in range(len(others))
    ]
