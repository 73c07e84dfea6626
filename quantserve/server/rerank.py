"""POST /v1/rerank and /rerank in the Jina/Cohere shape (as llama-server and vLLM serve them): a query and
documents in, the documents' indices by relevance out, each scored by a cross-encoder's head or by the model as
a yes/no judge (quantserve.rerank)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from quantserve.errors import InvalidRequestError
from quantserve.rerank import classify, judge, ranked, rerank_kind
from quantserve.server.state import ServerState

router = APIRouter()
MAX_DOCUMENTS = 1024


class TextDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | TextDocument] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    # the yes/no judge's task (Qwen3-Reranker's "Instruct"), a default otherwise; a cross-encoder takes none
    instruction: str | None = None


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.qs
    llm = await state.acquire(request, body.model)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    if any(not t for t in texts):
        i = next(i for i, t in enumerate(texts) if not t)
        raise InvalidRequestError(f"'documents[{i}]' is empty", param=f"documents[{i}]")
    kind = rerank_kind(llm)
    if kind is None:
        raise InvalidRequestError(
            f"model {llm.name!r} cannot rerank: it has no classification head and no chat template to judge "
            "with; serve a reranker or a chat model",
            param="model",
        )
    if kind == "classifier":
        scores, n_tokens = await classify(llm, body.query, texts)
    else:
        scores, n_tokens = await judge(llm, body.query, texts, body.instruction)
    results = []
    for r in ranked(scores, body.top_n):
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if body.return_documents:
            item["document"] = {"text": texts[r.index]}
        results.append(item)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "object": "list",
        "model": llm.name,
        "results": results,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }
