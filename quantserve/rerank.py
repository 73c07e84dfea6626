"""Reranking, by two kinds of model:

- a cross-encoder (bge-reranker, jina-reranker, … as llama.cpp's converter writes them): a classification head
  on the pooled query–document pair, run by llama.cpp's rank pooling (LLM.rank). One output is a logit, and the
  relevance is its sigmoid (as sentence-transformers' CrossEncoder and vLLM give it; llama-server returns the
  raw logit); two outputs labelled yes and no (Qwen3-Reranker converted by llama.cpp) are already llama.cpp's
  softmax, and the relevance is P(yes); two others are the not-relevant and relevant classes, and the relevance
  is the softmax's second.
- a causal LM as a yes/no judge (the Qwen3-Reranker recipe): each document goes after the query in the model's
  own chat template, and its relevance is the probability of "yes" over "yes" + "no" as the first token of the
  reply, i.e. the softmax over those two logits. Any chat model can judge this way, on either backend;
  Qwen3-Reranker is trained for exactly this prompt.

Either way the documents of a request run batched: the cross-encoder's several pairs per decode; the judge's as
one prompt each, given to the engine together once the first has computed the shared prefix (the instruction and
the query), which the others then reuse from the prefix cache.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass

from quantserve.errors import InvalidRequestError
from quantserve.llm import LLM

# Qwen3-Reranker's system prompt and default instruction (its model card), which other chat models follow too.
JUDGE_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class Ranked:
    index: int
    relevance_score: float


def answer_tokens(llm: LLM) -> tuple[int, int]:
    """The token ids of "yes" and "no" as the reply's first token.

    Raises:
        InvalidRequestError: the tokenizer splits either word (the model cannot be judged in one step).
    """
    ids = []
    for word in ("yes", "no"):
        toks = llm.tokenize_text(word)
        if len(toks) != 1:
            raise InvalidRequestError(
                f"model {llm.name!r} cannot rerank: its tokenizer splits {word!r} into {len(toks)} tokens",
                param="model",
            )
        ids.append(toks[0])
    return ids[0], ids[1]


def judge_prompt(llm: LLM, query: str, document: str, instruction: str | None = None) -> list[int]:
    """The tokens after which the model answers yes or no: system, the user turn with the instruction, the query
    and the document, then the assistant's turn opened (for a thinking template, with thinking left empty)."""
    user = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]
    return llm.tokenize_prompt(llm.render_chat(messages, enable_thinking=False), chat=True)


async def judge(
    llm: LLM, query: str, documents: list[str], instruction: str | None = None
) -> tuple[list[float], int]:
    """Each document's relevance in [0, 1], in the documents' order, and the prompt tokens used.

    Raises:
        InvalidRequestError: the model cannot be judged (see answer_tokens), or a prompt is over the context.
    """
    yes, no = answer_tokens(llm)
    prompts = [judge_prompt(llm, query, d, instruction) for d in documents]
    for i, p in enumerate(prompts):
        if len(p) >= llm.n_ctx:
            raise InvalidRequestError(
                f"documents[{i}] with the query makes {len(p)} tokens, over the context of {llm.n_ctx}; "
                "shorten it or serve the model with a larger --ctx-size",
                param=f"documents[{i}]",
            )
    params = llm.sampling_params(max_tokens=1, temperature=0.0, logprobs=True, logprob_tokens=(yes, no))
    rid = f"rerank-{uuid.uuid4().hex}"
    wave = max(
        1, llm.settings.max_queue_len // 2
    )  # in flight at once: batched, and leaving room in the queue
    outs = []
    # The first document goes alone: it computes the shared prefix (system, instruction, query), which the rest
    # then find cached (on llama.cpp, copied into their slots) instead of each computing it in the same step.
    for lo, hi in [(0, 1), *((k, k + wave) for k in range(1, len(prompts), wave))]:
        gens = []
        try:
            for i, p in enumerate(prompts[lo:hi], lo):
                gens.append(llm.generate(p, params, f"{rid}-{i}"))
            outs += await asyncio.gather(*(_last(g) for g in gens))
        finally:
            for g in gens:
                g.close()  # a request that goes away (or a refused one) aborts the rest
    scores = []
    for out in outs:
        lp_yes, lp_no = out.logprobs[0].asked
        scores.append(1.0 / (1.0 + math.exp(lp_no - lp_yes)))  # softmax over the two logits
    return scores, sum(len(p) for p in prompts)


async def _last(gen):
    last = None
    async for out in gen:
        last = out
    return last


async def classify(llm: LLM, query: str, documents: list[str]) -> tuple[list[float], int]:
    """A cross-encoder's relevance of each document in [0, 1], in the documents' order, and the tokens used.

    Raises:
        InvalidRequestError: a pair is over the context, or the head has more than two outputs.
    """
    if llm.rank_outputs > 2:
        raise InvalidRequestError(
            f"model {llm.name!r} has a classification head of {llm.rank_outputs} classes, not a relevance score "
            "(one logit, or two classes); serve a reranker",
            param="model",
        )
    outputs, n_tokens = await llm.rank(query, documents)
    if llm.rank_outputs == 1:
        return [_sigmoid(o[0]) for o in outputs], n_tokens
    if llm.rank_labels and llm.rank_labels[0].lower() == "yes":
        # Qwen3-Reranker as llama.cpp's converter writes it (the lm_head's yes and no rows): llama.cpp already
        # gives the softmax over the two, so P(yes) is the first
        return [o[0] for o in outputs], n_tokens
    return [_sigmoid(o[1] - o[0]) for o in outputs], n_tokens  # not relevant, relevant: the softmax's second


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def rerank_kind(llm: LLM) -> str | None:
    """How `llm` reranks: "classifier" (a cross-encoder's head), "judge" (a chat model answering yes or no), or
    None."""
    if "rerank" not in llm.plan.capabilities:  # more classes than two are no relevance score; no template
        return None
    return "classifier" if llm.rank_outputs else "judge"


def ranked(scores: list[float], top_n: int | None) -> list[Ranked]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [Ranked(i, scores[i]) for i in order[: top_n or None]]
