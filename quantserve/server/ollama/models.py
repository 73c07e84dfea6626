"""Ollama's model routes (docs/api.md of the ollama repository): /api/version, tags, ps and show describe the
served models from their files' headers and the loaded ones; pull, delete and copy act on this server's models,
its in-situ cache and its names; create, push and blobs answer a 501 that says what to use instead."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from quantserve import __version__
from quantserve.errors import InvalidRequestError, ModelNotFoundError, QuantserveError
from quantserve.insitu.cache import QuantCache
from quantserve.server.ollama.protocol import CopyBody, NameBody, ndjson, tagged, untagged
from quantserve.server.served import Served
from quantserve.server.state import ServerState

log = logging.getLogger("quantserve.server")
router = APIRouter()
API_VERSION = "0.12.0"  # the Ollama API these routes follow; clients check it before they use newer fields


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
    }


def _params_text(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _facts(served: Served) -> dict[str, Any] | None:
    if served.resolved is None:
        return None
    path = Path(served.resolved.path)
    try:
        return _file_facts(str(path), path.stat().st_mtime)
    except (OSError, QuantserveError):
        return None


# Ollama's names for the plan's capabilities (quantserve.core.plan); chat is not one of them. It has no name for
# rerank yet, so ours is kept for /v1/rerank.
_OLLAMA_CAPABILITIES = {"completion": "completion", "tools": "tools", "vision": "vision",
                        "embeddings": "embedding", "rerank": "rerank", "reasoning": "thinking"}  # fmt: skip


def _capabilities(served: Served) -> list[str]:
    """What the model can do, in Ollama's names, from its plan (the loaded model's, else the one made before loading)."""
    plan = served.llm.plan if served.llm is not None else served.plan
    if plan is None:  # not planned yet: a single model still loading, a hub entry not downloaded
        return ["completion"]
    return [_OLLAMA_CAPABILITIES[c] for c in plan.capabilities if c in _OLLAMA_CAPABILITIES]


def _entry(served: Served, facts: dict[str, Any] | None) -> dict[str, Any]:
    name = tagged(served.name)
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
    served_models = list(state.router.served_models.values())
    facts = await asyncio.to_thread(lambda: [_facts(s) for s in served_models])
    listed = [_entry(s, f) for s, f in zip(served_models, facts, strict=True)]
    for copy, name in state.copies.items():
        i = next(i for i, s in enumerate(served_models) if s.name == name)
        listed.append({**listed[i], "name": tagged(copy), "model": tagged(copy)})
    return {"models": listed}


@router.get("/api/ps")
async def ps(request: Request):
    state: ServerState = request.app.state.qs
    out = []
    for served in state.router.served_models.values():
        if served.llm is None:
            continue
        facts = await asyncio.to_thread(_facts, served)
        entry = _entry(served, facts)
        idle = served.keep_alive
        expires = (
            datetime.fromtimestamp(time.time() + idle + (served.last_used - time.monotonic()), UTC)
            if idle is not None and (not served.pinned or served.parked)
            else datetime(2318, 1, 1, tzinfo=UTC)  # never: Ollama's own far-future date for keep_alive -1
        )
        size = served.estimate or (facts or {}).get("size", 0)
        entry |= {
            "size": size,
            "size_vram": int(size * served.llm.gpu_share),
            "expires_at": expires.isoformat().replace("+00:00", "Z"),
            "context_length": served.llm.n_ctx,
        }
        out.append(entry)
    return {"models": out}


@router.post("/api/show")
async def show(body: NameBody, request: Request):
    state: ServerState = request.app.state.qs
    served = state.router.find(untagged(body.target))
    facts = await asyncio.to_thread(_facts, served)
    info: dict[str, Any] = {}
    if served.resolved is not None:
        info = await asyncio.to_thread(_model_info, Path(served.resolved.path), body.verbose)
    llm = served.llm
    template = llm.chat_template.source if llm is not None and llm.chat_template is not None else ""
    defaults = served.settings.for_model(served.resolved.entry).sampling_defaults if served.resolved else {}
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repeat_penalty": "repeat_penalty", "penalty_last_n": "repeat_last_n"}  # fmt: skip
    params = "\n".join(f"{names[k]:<30} {v}" for k, v in defaults.items() if k in names)
    out: dict[str, Any] = {
        "modelfile": f"# served by quantserve {__version__}\nFROM {served.resolved.path if served.resolved else served.name}\n",
        "parameters": params,
        "template": template,
        "details": (facts or {}).get("details", {}),
        "model_info": info,
        "capabilities": _capabilities(served),
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
    served = state.router.find(untagged(body.target))
    leases: list = []

    async def statuses() -> AsyncIterator[dict]:
        yield {"status": "pulling manifest"}
        await state.router.acquire(leases, served.name)
        state.router.release(leases)
        yield {"status": "verifying sha256 digest"}
        yield {"status": "success"}

    if body.stream:
        return ndjson(statuses())
    async for _ in statuses():
        pass
    return {"status": "success"}


@router.delete("/api/delete")
async def delete(body: NameBody, request: Request):
    """Unloads the model and removes what quantserve made of it (its in-situ conversions in the cache). The
    model's own files and its models.toml entry are the user's and stay."""
    state: ServerState = request.app.state.qs
    served = state.router.find(untagged(body.target))
    copy = state.copies.pop(untagged(body.target).lower(), None)
    if copy is not None:  # a name /api/copy made: only the name goes
        served.names -= {untagged(body.target).lower()}
        return JSONResponse({})
    state.router.unload_on_request(served, "deleted")
    if served.task is not None and served.status == "unloading":
        await asyncio.shield(served.task)
    if served.resolved is not None:
        cache = QuantCache(Path(served.settings.cache_dir) if served.settings.cache_dir else None)
        gone = await asyncio.to_thread(cache.remove_source, Path(served.resolved.path))
        log.info("deleted %d in-situ conversion(s) of %s", len(gone), served.name)
    return JSONResponse({})


@router.post("/api/copy")
async def copy(body: CopyBody, request: Request):
    """A new name for the model, listed by /api/tags beside it, for this server's lifetime (names that last
    belong in models.toml as aliases)."""
    state: ServerState = request.app.state.qs
    served = state.router.find(untagged(body.source))
    dest = untagged(body.destination).lower()
    try:
        other = state.router.find(dest)
    except ModelNotFoundError:
        other = None
    if other is not None and other is not served:
        raise InvalidRequestError(
            f"{body.destination!r} already names the model {other.name!r}", param="destination"
        )
    if other is None:
        served.names |= {dest}
        state.copies[dest] = served.name
    return JSONResponse({})


_INSTEAD = {
    "create": "quantserve does not build models from Modelfiles; convert or quantize with `quantserve convert`, "
    "and name the result in models.toml",
    "push": "quantserve does not publish models; upload the files to a model hub",
    "blobs": "quantserve reads model files from paths and models.toml, not from uploaded blobs",
}


@router.api_route("/api/create", methods=["POST"])
@router.api_route("/api/push", methods=["POST"])
async def unsupported(request: Request):
    what = request.url.path.split("/")[2]
    return JSONResponse({"error": f"/api/{what} is not supported: {_INSTEAD[what]}"}, status_code=501)


@router.api_route("/api/blobs/{digest}", methods=["HEAD", "POST"])
async def unsupported_blobs(request: Request, digest: str):
    """(`digest` is a parameter so that the OpenAPI schema declares it.)"""
    return await unsupported(request)
