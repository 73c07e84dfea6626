"""Ollama's native API on the same server and router as the OpenAI and Anthropic ones (docs/api.md of the ollama
repository): /api/version, tags, show, ps, chat, generate, embed, embeddings, pull, delete and copy. Streams are
NDJSON, durations nanoseconds, and errors Ollama's `{"error": "..."}` (server/errors.py). Model names may carry
Ollama's `:latest` tag.

keep_alive works as in Ollama: 0 unloads the model once the request is done, a duration sets how long it stays
loaded while idle, a negative one keeps it. A single-model server reloads its model on the next request after
such an unload.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantserve import __version__
from quantserve.chat import ChatRequest
from quantserve.errors import InvalidRequestError, ModelNotFoundError, QuantserveError
from quantserve.insitu.cache import QuantCache
from quantserve.llm import LLM
from quantserve.rerank import rerank_kind
from quantserve.server.generation import Choice, collect, merge, start, start_chat, until_disconnect
from quantserve.server.ollama.protocol import (
    ChatBody,
    CopyBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    KeepAlive,
    NameBody,
    Options,
    chat_request,
    image_part,
    keep_alive_seconds,
    response_schema,
)
from quantserve.server.slot import Slot
from quantserve.server.state import ServerState
from quantserve.structured.grammars import json_schema_grammar

log = logging.getLogger("quantserve.server")
router = APIRouter()
API_VERSION = "0.12.0"  # the Ollama API these routes follow; clients check it before they use newer fields
NDJSON = "application/x-ndjson"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(1, int(seconds * 1e9))


def _name(model: str) -> str:
    """Ollama's `name:latest` is the model `name`; other tags are part of the name."""
    return model[: -len(":latest")] if model.endswith(":latest") else model


def _tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


class Clock:
    """The final object's timing fields, from real timestamps: load (finding or loading the model), prompt
    evaluation (until the first token), generation (from it to the last)."""

    def __init__(self) -> None:
        self.start = self.loaded = self.first = time.perf_counter()

    def mark_loaded(self) -> None:
        self.loaded = self.first = time.perf_counter()

    def mark_first(self) -> None:
        self.first = time.perf_counter()

    def fields(self, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
        end = time.perf_counter()
        return {
            "total_duration": _ns(end - self.start),
            "load_duration": _ns(self.loaded - self.start),
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": _ns(self.first - self.loaded),
            "eval_count": output_tokens,
            "eval_duration": _ns(end - self.first),
        }


async def _acquire(request: Request, model: str, keep_alive: KeepAlive) -> tuple[LLM, Slot, Clock]:
    """The model, loaded and leased for this request; a keep_alive duration is applied now, a zero one once
    the request is done (_unload_after)."""
    state: ServerState = request.app.state.qs
    clock = Clock()
    seconds = keep_alive_seconds(keep_alive)
    slot = state.router.find(_name(model))
    llm = await state.acquire(request, _name(model))
    clock.mark_loaded()
    if keep_alive is not None and seconds != 0:
        state.router.set_keep_alive(slot, seconds)
    return llm, slot, clock


def _unload_after(state: ServerState, slot: Slot, keep_alive: KeepAlive) -> bool:
    """keep_alive 0: the model unloads once this request's lease is given back. Returns whether it will."""
    if keep_alive is None or keep_alive_seconds(keep_alive) != 0:
        return False
    return state.router.unload_on_request(slot, "keep_alive=0")


def _params(llm: LLM, options: Options | None, n_prompt: int, grammar, skip_special: bool):
    options = options or Options()
    return llm.sampling_params(
        max_tokens=llm.check_context(n_prompt, options.max_tokens),
        grammar=grammar,
        skip_special_tokens=skip_special,
        **options.sampling(),
    )


def _check_think(llm: LLM, think) -> None:
    if think not in (None, False):
        raise InvalidRequestError(f"{_tagged(llm.name)!r} does not support thinking", param="think")


def _ndjson(objs: AsyncIterator[dict]) -> StreamingResponse:
    """A stream of JSON lines; a failure after the first line becomes an `{"error": ...}` line, which Ollama's
    clients raise."""

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for obj in objs:
                yield (json.dumps(obj, ensure_ascii=False) + "\n").encode()
        except Exception as exc:  # noqa: BLE001 - reported in the stream, as Ollama does, and logged
            log.exception("generation failed mid-stream")
            message = exc.message if isinstance(exc, QuantserveError) else f"{type(exc).__name__}: {exc}"
            yield (json.dumps({"error": f"generation failed: {message}"}) + "\n").encode()

    return StreamingResponse(lines(), media_type=NDJSON)


def _tool_calls(c: Choice) -> list[dict[str, Any]]:
    assert c.reply is not None
    return [{"function": {"name": t.name, "arguments": json.loads(t.arguments)}} for t in c.reply.tool_calls]


def _done_reason(c: Choice) -> str:
    reason = c.reply.finish_reason if c.reply is not None else c.finish_reason
    return "length" if reason == "length" else "stop"


def _load_only(request: Request, body, slot: Slot, kind: str) -> dict[str, Any]:
    """An empty chat or prompt: load the model (and with keep_alive 0, unload it)."""
    unload = _unload_after(request.app.state.qs, slot, body.keep_alive)
    out: dict[str, Any] = {"model": _tagged(_name(body.model)), "created_at": _now()}
    out |= {"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""}
    return {**out, "done_reason": "unload" if unload else "load", "done": True}


@router.post("/api/chat")
async def chat(body: ChatBody, request: Request):
    state: ServerState = request.app.state.qs
    llm, slot, clock = await _acquire(request, body.model, body.keep_alive)
    if not body.messages:
        return _load_only(request, body, slot, "chat")
    _check_think(llm, body.think)
    reader = state.reader(llm)
    req = chat_request(body, reader)
    prompt, tokens, images = llm.prepare_chat(req, await reader.load(state.media))
    params = _params(llm, body.options, len(tokens), prompt.grammar, prompt.skip_special_tokens)
    gens, choices = start_chat(llm, prompt, tokens, params, 1, f"ollama-{uuid.uuid4().hex}", images)
    c = choices[0]
    head = {"model": _tagged(_name(body.model))}

    def final() -> dict[str, Any]:
        _unload_after(state, slot, body.keep_alive)
        stats = clock.fields(len(tokens), c.num_output_tokens)
        return {**head, "created_at": _now(), "done_reason": _done_reason(c), "done": True, **stats}

    if body.stream:

        async def stream() -> AsyncIterator[dict]:
            first = True
            async for _, out in merge(gens):
                if first:
                    clock.mark_first()
                    state.observe_ttft(llm, clock.start)
                    first = False
                text = "".join(e.text for e in c.take(out) if hasattr(e, "text"))
                if text:
                    yield {**head, "created_at": _now(), "message": {"role": "assistant", "content": text},
                           "done": False}  # fmt: skip
            state.record(llm, choices, [tokens], clock.start)
            if c.reply is not None and c.reply.tool_calls:
                message = {"role": "assistant", "content": "", "tool_calls": _tool_calls(c)}
                yield {**head, "created_at": _now(), "message": message, "done": False}
            yield {**final(), "message": {"role": "assistant", "content": ""}}

        return _ndjson(stream())

    if not await until_disconnect(request, collect(gens, choices, clock.mark_first)):
        return JSONResponse({}, status_code=499)
    state.record(llm, choices, [tokens], clock.start)
    assert c.reply is not None
    message: dict[str, Any] = {"role": "assistant", "content": c.reply.content or ""}
    if c.reply.tool_calls:
        message["tool_calls"] = _tool_calls(c)
    return {**final(), "message": message}


@router.post("/api/generate")
async def generate(body: GenerateBody, request: Request):
    state: ServerState = request.app.state.qs
    llm, slot, clock = await _acquire(request, body.model, body.keep_alive)
    if not body.prompt and not body.images:
        return _load_only(request, body, slot, "generate")
    _check_think(llm, body.think)
    if body.suffix:
        raise InvalidRequestError(
            f"{_tagged(llm.name)!r} does not support insert (suffix): it has no fill-in-the-middle template",
            param="suffix",
        )
    if body.template:
        raise InvalidRequestError(
            "'template' (a Go template) is not supported; send raw: true with the prompt already formatted",
            param="template",
        )
    images: list = []
    spans: list = []
    grammar, skip_special = None, True
    if body.raw or llm.chat_template is None:
        if body.images:
            raise InvalidRequestError(
                "'images' need the model's chat template (raw is false)", param="images"
            )
        tokens = llm.tokenize_prompt(body.prompt or "", chat=False)
    else:
        reader = state.reader(llm)
        parts = [image_part(b, f"images[{j}]", reader) for j, b in enumerate(body.images or [])]
        content: Any = [*parts, {"type": "text", "text": body.prompt or ""}] if parts else body.prompt or ""
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": content}
        ]
        req = ChatRequest(messages, response_schema=response_schema(body.format))
        prompt, tokens, spans = llm.prepare_chat(req, await reader.load(state.media))
        grammar, skip_special = prompt.grammar, prompt.skip_special_tokens
    if body.context:
        tokens = list(body.context) + tokens
    if body.raw and body.format:
        schema = response_schema(body.format)
        grammar = json_schema_grammar(schema, param="format") if schema is not None else None
    params = _params(llm, body.options, len(tokens), grammar, skip_special)
    gens, choices = start(llm, [tokens], params, 1, f"ollama-{uuid.uuid4().hex}", spans or images or None)
    c = choices[0]
    head = {"model": _tagged(_name(body.model))}

    def final() -> dict[str, Any]:
        _unload_after(state, slot, body.keep_alive)
        stats = clock.fields(len(tokens), c.num_output_tokens)
        out = {**head, "created_at": _now(), "done": True, "done_reason": _done_reason(c), **stats}
        if not body.raw:
            out["context"] = tokens + llm.tokenize_prompt(c.text, chat=False) if c.text else tokens
        return out

    if body.stream:

        async def stream() -> AsyncIterator[dict]:
            first = True
            async for _, out in merge(gens):
                if first:
                    clock.mark_first()
                    state.observe_ttft(llm, clock.start)
                    first = False
                c.take(out)
                if out.text:
                    yield {**head, "created_at": _now(), "response": out.text, "done": False}
            state.record(llm, choices, [tokens], clock.start)
            yield {**final(), "response": ""}

        return _ndjson(stream())

    if not await until_disconnect(request, collect(gens, choices, clock.mark_first)):
        return JSONResponse({}, status_code=499)
    state.record(llm, choices, [tokens], clock.start)
    return {**final(), "response": c.text}


@router.post("/api/embed")
async def embed(body: EmbedBody, request: Request):
    llm, slot, clock = await _acquire(request, body.model, body.keep_alive)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or any(not t for t in texts):
        raise InvalidRequestError("'input' must hold text", param="input")
    vectors, n = [], 0
    for text in texts:
        tokens = llm.tokenize_prompt(text, chat=False)
        if len(tokens) > llm.n_ctx:
            if not body.truncate:
                raise InvalidRequestError(
                    f"the input has {len(tokens)} tokens, over the context of {llm.n_ctx}; send truncate: true",
                    param="input",
                )
            tokens = tokens[: llm.n_ctx]
        n += len(tokens)
        vec = np.asarray(await llm.embed(tokens), dtype=np.float64)
        norm = float(np.linalg.norm(vec))
        vectors.append((vec / norm if norm > 0 else vec).tolist())  # /api/embed's vectors are unit length
    if body.dimensions is not None:
        raise InvalidRequestError("'dimensions' is not supported by this model", param="dimensions")
    _unload_after(request.app.state.qs, slot, body.keep_alive)
    stats = clock.fields(n, 0)
    return {"model": _tagged(_name(body.model)), "embeddings": vectors, "total_duration": stats["total_duration"],
            "load_duration": stats["load_duration"], "prompt_eval_count": n}  # fmt: skip


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsBody, request: Request):
    llm, slot, _ = await _acquire(request, body.model, body.keep_alive)
    if not body.prompt:
        return {"embedding": []}
    vec = await llm.embed(llm.tokenize_prompt(body.prompt, chat=False)[: llm.n_ctx])
    _unload_after(request.app.state.qs, slot, body.keep_alive)
    return {"embedding": list(vec)}


# ---- models ---------------------------------------------------------------------------------------------


@cache
def _file_facts(path: str, mtime: float) -> dict[str, Any]:
    """What Ollama's listings say of a model file or directory, from its headers (cached per file version)."""
    from quantserve.formats import summarize

    s = summarize(Path(path))
    quant = s.quant.get("file_type") or (f"{s.quant.get('bits')}bit" if s.quant.get("bits") else None)
    quant = (
        quant or str(s.quant.get("dtype", "")).upper().replace("FLOAT", "F").replace("BF", "BF") or "unknown"
    )
    family = (s.architecture or "unknown").lower().removesuffix("forcausallm")
    return {
        "size": s.file_size,
        "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
        "digest": hashlib.sha256(f"{path}:{mtime}:{s.file_size}".encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": s.format,
            "family": family,
            "families": [family],
            "parameter_size": _params_text(s.n_params),
            "quantization_level": quant,
        },
        "has_chat_template": s.has_chat_template,
        "context_length": s.context_length,
        "vision": s.vision is not None and s.mmproj is not None or (s.vision or "").startswith("LLaVA"),
    }


def _params_text(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _facts(slot: Slot) -> dict[str, Any] | None:
    if slot.resolved is None:
        return None
    path = Path(slot.resolved.path)
    try:
        return _file_facts(str(path), path.stat().st_mtime)
    except (OSError, QuantserveError):
        return None


def _capabilities(slot: Slot, facts: dict[str, Any] | None) -> list[str]:
    """Ollama's names for what the model can do: from the loaded model, else from what is known before loading
    (a chat template means tools: every template gets a tool-call format)."""
    llm = slot.llm
    if llm is not None:
        caps = [] if llm.rank_outputs else ["completion"]
        caps += (
            ["tools"] if llm.chat_template is not None and llm.tool_format and not llm.rank_outputs else []
        )
        caps += ["vision"] if llm.takes_images else []
        caps += ["embedding"] if llm.can_embed else []
        caps += ["rerank"] if rerank_kind(llm) else []  # /v1/rerank (Ollama has no name for it yet)
        return caps
    known = slot.facts.get("capabilities", [])
    if known and "completion" not in known:  # a reranker
        return [c for c in known if c == "rerank"]
    caps = ["completion", *(["tools"] if "chat" in known else [])]
    return caps + (["vision"] if "vision" in known or (facts or {}).get("vision") else [])


def _entry(slot: Slot, facts: dict[str, Any] | None) -> dict[str, Any]:
    name = _tagged(slot.name)
    out: dict[str, Any] = {"name": name, "model": name}
    if facts:
        out |= {k: facts[k] for k in ("modified_at", "size", "digest", "details")}
    return out


@router.get("/api/version")
async def version():
    return {"version": API_VERSION, "quantserve": __version__}


@router.get("/api/tags")
async def tags(request: Request):
    state: ServerState = request.app.state.qs
    slots = list(state.router.slots.values())
    facts = await asyncio.to_thread(lambda: [_facts(s) for s in slots])
    models = [_entry(s, f) for s, f in zip(slots, facts, strict=True)]
    for copy, name in state.copies.items():
        i = next(i for i, s in enumerate(slots) if s.name == name)
        models.append({**models[i], "name": _tagged(copy), "model": _tagged(copy)})
    return {"models": models}


@router.get("/api/ps")
async def ps(request: Request):
    state: ServerState = request.app.state.qs
    out = []
    for slot in state.router.slots.values():
        if slot.llm is None:
            continue
        facts = await asyncio.to_thread(_facts, slot)
        entry = _entry(slot, facts)
        idle = slot.keep_alive
        expires = (
            datetime.fromtimestamp(time.time() + idle + (slot.last_used - time.monotonic()), UTC)
            if idle is not None and (not slot.pinned or slot.parked)
            else datetime(2318, 1, 1, tzinfo=UTC)  # never: Ollama's own far-future date for keep_alive -1
        )
        size = slot.estimate or (facts or {}).get("size", 0)
        entry |= {
            "size": size,
            "size_vram": int(size * slot.llm.gpu_share),
            "expires_at": expires.isoformat().replace("+00:00", "Z"),
            "context_length": slot.llm.n_ctx,
        }
        out.append(entry)
    return {"models": out}


@router.post("/api/show")
async def show(body: NameBody, request: Request):
    state: ServerState = request.app.state.qs
    slot = state.router.find(_name(body.target))
    facts = await asyncio.to_thread(_facts, slot)
    info: dict[str, Any] = {}
    if slot.resolved is not None:
        info = await asyncio.to_thread(_model_info, Path(slot.resolved.path), body.verbose)
    llm = slot.llm
    template = llm.chat_template.source if llm is not None and llm.chat_template is not None else ""
    defaults = slot.settings.for_model(slot.resolved.entry).sampling_defaults if slot.resolved else {}
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repeat_penalty": "repeat_penalty", "penalty_last_n": "repeat_last_n"}  # fmt: skip
    params = "\n".join(f"{names[k]:<30} {v}" for k, v in defaults.items() if k in names)
    out: dict[str, Any] = {
        "modelfile": f"# served by quantserve {__version__}\nFROM {slot.resolved.path if slot.resolved else slot.name}\n",
        "parameters": params,
        "template": template,
        "details": (facts or {}).get("details", {}),
        "model_info": info,
        "capabilities": _capabilities(slot, facts),
    }
    if facts:
        out["modified_at"] = facts["modified_at"]
    return out


def _model_info(path: Path, verbose: bool) -> dict[str, Any]:
    """A GGUF's metadata (its big arrays only with verbose, as Ollama does), or an HF config's keys."""
    from quantserve.formats import detect, read_gguf_info

    spec = detect(path)
    if spec.format == "gguf":
        meta = read_gguf_info(spec.files[0]).metadata
        return {k: (v if verbose or not isinstance(v, list) or len(v) <= 64 else []) for k, v in meta.items()}
    return {f"config.{k}": v for k, v in (spec.config or {}).items() if not isinstance(v, dict)}


@router.post("/api/pull")
async def pull(body: NameBody, request: Request):
    """The model is one of this server's: loaded (downloaded first, for a hub entry) as `pull` would fetch it;
    the stream says so. Nothing else can be pulled: quantserve serves models.toml's entries and paths."""
    state: ServerState = request.app.state.qs
    slot = state.router.find(_name(body.target))
    leases: list = []

    async def statuses() -> AsyncIterator[dict]:
        yield {"status": "pulling manifest"}
        await state.router.acquire(leases, slot.name)
        state.router.release(leases)
        yield {"status": "verifying sha256 digest"}
        yield {"status": "success"}

    if body.stream:
        return _ndjson(statuses())
    async for _ in statuses():
        pass
    return {"status": "success"}


@router.delete("/api/delete")
async def delete(body: NameBody, request: Request):
    """Unloads the model and removes what quantserve made of it (its in-situ conversions in the cache). The
    model's own files and its models.toml entry are the user's and stay."""
    state: ServerState = request.app.state.qs
    slot = state.router.find(_name(body.target))
    copy = state.copies.pop(_name(body.target).lower(), None)
    if copy is not None:  # a name /api/copy made: only the name goes
        slot.names -= {_name(body.target).lower()}
        return JSONResponse({})
    state.router.unload_on_request(slot, "deleted")
    if slot.task is not None and slot.status == "unloading":
        await asyncio.shield(slot.task)
    if slot.resolved is not None:
        cache = QuantCache(Path(slot.settings.cache_dir) if slot.settings.cache_dir else None)
        gone = await asyncio.to_thread(cache.remove_source, Path(slot.resolved.path))
        log.info("deleted %d in-situ conversion(s) of %s", len(gone), slot.name)
    return JSONResponse({})


@router.post("/api/copy")
async def copy(body: CopyBody, request: Request):
    """A new name for the model, listed by /api/tags beside it, for this server's lifetime (names that last
    belong in models.toml as aliases)."""
    state: ServerState = request.app.state.qs
    slot = state.router.find(_name(body.source))
    dest = _name(body.destination).lower()
    try:
        other = state.router.find(dest)
    except ModelNotFoundError:
        other = None
    if other is not None and other is not slot:
        raise InvalidRequestError(
            f"{body.destination!r} already names the model {other.name!r}", param="destination"
        )
    if other is None:
        slot.names |= {dest}
        state.copies[dest] = slot.name
    return JSONResponse({})


_INSTEAD = {
    "create": "quantserve does not build models from Modelfiles; convert or quantize with `quantserve convert`, "
    "and name the result in models.toml",
    "push": "quantserve does not publish models; upload the files to a model hub",
    "blobs": "quantserve reads model files from paths and models.toml, not from uploaded blobs",
}


@router.api_route("/api/create", methods=["POST"])
@router.api_route("/api/push", methods=["POST"])
@router.api_route("/api/blobs/{digest}", methods=["HEAD", "POST"])
async def unsupported(request: Request):
    what = request.url.path.split("/")[2]
    return JSONResponse({"error": f"/api/{what} is not supported: {_INSTEAD[what]}"}, status_code=501)
