"""/v1/embeddings: OpenAI's embeddings, one vector per input (a text, or token ids), as floats or base64."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request

from quantserve.errors import EmbeddingsUnsupportedError, InvalidRequestError
from quantserve.server.openai.protocol import EmbeddingRequest
from quantserve.server.state import ServerState

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    state: ServerState = request.app.state.qs
    llm = await state.acquire(request, body.model)
    if body.dimensions is not None:
        raise EmbeddingsUnsupportedError("'dimensions' is not supported by this model", param="dimensions")
    inputs = body.input
    if isinstance(inputs, str):
        batches = [llm.tokenize_prompt(inputs, chat=False)]
    elif inputs and all(isinstance(x, int) for x in inputs):
        batches = [list(inputs)]
    else:
        batches = [llm.tokenize_prompt(x, chat=False) if isinstance(x, str) else list(x) for x in inputs]
    if not batches or any(not b for b in batches):
        raise InvalidRequestError("'input' must not be empty", param="input")
    for tokens in batches:
        llm.check_tokens(tokens, "input")
    data = []
    for i, tokens in enumerate(batches):
        vec = await llm.embed(tokens)
        if body.encoding_format == "base64":  # what the openai client asks for: little-endian float32
            vec = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vec})
    n = sum(len(b) for b in batches)
    return {
        "object": "list",
        "data": data,
        "model": llm.name,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
