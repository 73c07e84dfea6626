"""Quality metrics: perplexity (llama-perplexity's convention) and KL divergence between two models, scored by
llama.cpp or by quantserve's own torch model on the same chunks of the same tokens (what a conversion cost is
measured with these in conversion_quality.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import llama_cpp as lc
import numpy as np

from quantserve.errors import ConfigError, InvalidRequestError, require_torch

BACKENDS = ("llamacpp", "torch")

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


def _log_softmax(x: np.ndarray) -> np.ndarray:
    y = x - x.max(axis=-1, keepdims=True)
    return y - np.log(np.exp(y).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)


class Scorer(Protocol):
    """One model that scores chunks: llama.cpp's (ChunkScorer) or the torch backend's (TorchChunkScorer)."""

    n_ctx: int
    n_vocab: int
    scored_by: str  # what the CLI prints

    def tokenize(self, text: str) -> list[int]: ...

    def chunks(self, tokens: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...

    def close(self) -> None: ...


def _chunks(tokens: list[int], n_ctx: int, bos: int | None) -> Iterator[list[int]]:
    """llama-perplexity's chunks: n_ctx tokens each, the first replaced by BOS when the vocabulary adds one."""
    for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
        chunk = list(tokens[start : start + n_ctx])
        if bos is not None:
            chunk[0] = bos
        yield chunk


class ChunkScorer:
    """A llama.cpp context that returns the logits of every position of a chunk (n_ctx tokens, one batch).

    Chunks follow llama-perplexity: text split into n_ctx-token chunks, the first token of each replaced by BOS
    when the vocabulary adds one, and only the second half of each chunk scored (so every scored token has at
    least n_ctx/2 tokens of context)."""

    def __init__(self, path: Path, *, n_ctx: int = 512, threads: int = 0):
        from quantserve.backends.llamacpp.library import init_backend
        from quantserve.formats import read_gguf_info

        read_gguf_info(path)  # validated before llama.cpp opens it
        init_backend()
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise ConfigError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        cp.flash_attn_type = 0
        cp.n_threads = cp.n_threads_batch = threads or 2
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = n_ctx
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)
        self.scored_by = "llama.cpp"

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (lc.llama_token * (len(data) + 16))()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, False)
        return buf[:n]

    def chunks(self, tokens: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (log-probs [n_ctx/2 - 1, vocab] of the scored positions, their target tokens) per chunk."""
        n, first = self.n_ctx, self.n_ctx // 2
        bos = lc.llama_vocab_bos(self.vocab) if lc.llama_vocab_get_add_bos(self.vocab) else None
        for chunk in _chunks(tokens, n, bos):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
            b = self.batch
            for j, t in enumerate(chunk):
                # logits only where they are scored: the output layer over the vocabulary is the costly part
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, j, 1, int(j >= first)
                b.seq_id[j][0] = 0
            b.n_tokens = n
            if lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed while scoring")
            # rows come back in batch order for the positions that asked for logits: first .. n-1
            logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(n - first, self.n_vocab))
            yield _log_softmax(logits[:-1]), np.asarray(chunk[first + 1 : n])

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


class TorchChunkScorer:
    """The torch backend's model (loaded as `quantserve serve --backend torch` loads it: dense or GPTQ/AWQ/
    compressed-tensors/Marlin HF checkpoints, on CUDA in bf16/fp16, else on CPU in fp32) scoring the same chunks
    as ChunkScorer: the HF tokenizer reproduces llama.cpp's tokens, and one causal forward per chunk computes the
    output layer for the scored half only."""

    def __init__(self, path: Path, *, n_ctx: int = 512, threads: int = 0):
        import torch

        from quantserve.backends.torch.backend import pick_device_dtype
        from quantserve.backends.torch.tokenizer import HFTokenizer
        from quantserve.backends.torch.weights import load_model
        from quantserve.formats import detect

        spec = detect(path)
        if spec.format == "gguf":
            raise ConfigError(
                f"{path} is GGUF; the torch backend reads HF checkpoints: convert it first (quantserve convert "
                f"--src {path} --dst DIR --dtype fp32), let `quantserve eval` do it, or score with llamacpp"
            )
        if threads:
            torch.set_num_threads(threads)
        self.device, dtype = pick_device_dtype(spec.config or {})
        self.tokenizer = HFTokenizer.from_dir(spec.directory)
        self.model = load_model(spec, dtype=dtype, device=self.device)
        self.n_vocab = self.model.args.vocab_size
        self.n_ctx = n_ctx
        self.scored_by = f"torch ({self.device.type}, {str(dtype).removeprefix('torch.')})"

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=True, parse_special=False)

    def chunks(self, tokens: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (log-probs [n_ctx/2 - 1, vocab] of the scored positions, their target tokens) per chunk."""
        import torch

        n, first = self.n_ctx, self.n_ctx // 2
        tok = self.tokenizer
        bos = tok.bos_token_id if tok.add_bos and tok.bos_token_id >= 0 else None
        for chunk in _chunks(tokens, n, bos):
            with torch.inference_mode():
                ids = torch.tensor([chunk], device=self.device)  # [1, n]
                # [n/2 - 1, D]: the positions whose next token is scored
                hidden = self.model(ids)[0, first : n - 1]
                logp = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)  # [n/2 - 1, V] fp32
            yield logp.cpu().numpy(), np.asarray(chunk[first + 1 : n])

    def close(self) -> None:
        self.model = None


def open_scorer(path: Path, backend: str = "llamacpp", *, n_ctx: int = 512, threads: int = 0) -> Scorer:
    """A scorer for `path` on `backend`: llamacpp takes a GGUF file, torch an HF checkpoint directory.

    Raises:
        ConfigError: an unknown backend, or a file the backend cannot read.
    """
    if backend == "llamacpp":
        return ChunkScorer(path, n_ctx=n_ctx, threads=threads)
    if backend == "torch":
        require_torch("scoring with --backend torch")
        return TorchChunkScorer(path, n_ctx=n_ctx, threads=threads)
    raise ConfigError(f"unknown scoring backend {backend!r}; choose one of {', '.join(BACKENDS)}")


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
    scorer = open_scorer(path, backend, n_ctx=n_ctx, threads=threads)
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
    a = open_scorer(base, backend, n_ctx=n_ctx, threads=threads)
    try:
        b = open_scorer(model, backend, n_ctx=n_ctx, threads=threads)
    except BaseException:
        a.close()
        raise
    try:
        if a.n_vocab != b.n_vocab:
            raise ConfigError(
                f"vocabularies differ ({a.n_vocab} vs {b.n_vocab} tokens); KL needs the same vocab"
            )
        tokens = _tokens(a, text)
        if b.tokenize(text) != tokens:
            raise ConfigError("the two models tokenize the text differently; KL needs the same tokenizer")
        kl = nll_a = nll_b = 0.0
        agree = count = 0
        pairs = zip(a.chunks(tokens), b.chunks(tokens), strict=True)
        for done, ((lp, targets), (lq, _)) in enumerate(pairs, start=1):
            rows = np.arange(len(targets))
            kl += float((np.exp(lp) * (lp - lq)).sum())
            agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
            nll_a -= float(lp[rows, targets].sum())
            nll_b -= float(lq[rows, targets].sum())
            count += len(targets)
            if progress:
                progress(done, len(tokens) // n_ctx)
    finally:
        a.close()
        b.close()
    return KLResult(
        kl / count, agree / count, math.exp(nll_a / count), math.exp(nll_b / count), count, a.scored_by
    )
