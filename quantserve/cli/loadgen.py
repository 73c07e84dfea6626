"""A load generator for any OpenAI-compatible server: concurrent streamed requests, each timed (TTFT, TPOT,
latency, tokens); loadgen_report.py turns the records into tok/s and percentiles."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from quantserve.cli.loadgen_report import LoadResult, RequestResult, summarize
from quantserve.errors import ConfigError, QuantserveError

Endpoint = Literal["chat", "completions"]

# Questions that invite long answers, so that servers without `ignore_eos` still run close to max_tokens.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Write a long, detailed essay about the history of the Roman Empire, from its founding to its fall.",
    "Explain step by step how a car engine works, covering every major part in detail.",
    "Tell me a very long story about a dragon who wants to become a baker.",
    "Describe in detail how to plan a two-week trip through Japan, day by day.",
    "List and explain twenty tips for learning a new programming language.",
    "Explain how the internet works, from cables and routers up to web browsers.",
    "Write a detailed guide to growing vegetables in a small city garden.",
    "Describe the water cycle and its effect on weather and climate in great detail.",
)

_FILLER = (
    "The history of science is the study of how people came to understand the natural world, "
    "from early observations of the sky and seasons to modern experiments with particles and cells. "
    "Each generation built on the tools, mistakes and questions of the one before it. "
)


class ServerUnreachableError(QuantserveError):
    """No OpenAI-compatible server answered at the base URL in time."""

    code = "server_unreachable"


@dataclass(frozen=True)
class LoadSpec:
    """One load: `concurrency` clients sending `num_requests` requests in total, each as soon as the last ends."""

    base_url: str
    concurrency: int
    num_requests: int
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 128
    stream: bool = True
    endpoint: Endpoint = "chat"
    ignore_eos: bool = True  # sent only when true: servers that do not know the field never see it
    model: str | None = None
    temperature: float = 0.0
    api_key: str | None = None
    timeout: float = 600.0  # per request; a single-sequence server queues requests for a long time
    warmup: int = 0  # requests sent one at a time before the clock starts, excluded from every number
    # Set: request k's prompt starts "[tag.k] ", so no two requests share a prompt and no server can answer one
    # from a cached earlier one (llama-server keeps whole prompts in RAM). Pick a tag per load: levels and runs
    # that reuse prompts would otherwise measure prompt caching, not serving.
    tag: str | None = None

    def prompt(self, k: int) -> str:
        text = self.prompts[k % len(self.prompts)]
        return f"[{self.tag}.{k}] {text}" if self.tag else text


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _body(spec: LoadSpec, prompt: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": spec.stream,
    }
    if spec.model is not None:
        body["model"] = spec.model
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


def _error_text(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)
        msg = err.get("error", err) if isinstance(err, dict) else err
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except ValueError:
        msg = raw.decode(errors="replace")
    return f"HTTP {status}: {str(msg).strip()[:160]}"


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict, headers: dict, t0: float
) -> RequestResult:
    ttft: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return RequestResult(
                False, time.perf_counter() - t0, error=_error_text(resp.status_code, await resp.aread())
            )
        done = False
        async for line in resp.aiter_lines():
            if line.startswith("error:"):  # llama.cpp's llama-server reports mid-stream failures this way
                return RequestResult(
                    False, time.perf_counter() - t0, error=_error_text(200, line[6:].encode())
                )
            if not line.startswith("data:"):
                continue  # blank separators and ": ping" comments
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return RequestResult(False, time.perf_counter() - t0, error=_error_text(200, data.encode()))
            if _content(chunk):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
    latency = time.perf_counter() - t0
    if not done:
        return RequestResult(False, latency, error="the stream ended without data: [DONE]")
    tokens = usage_tokens if usage_tokens is not None else chunks
    return RequestResult(True, latency, ttft, tokens, tokens_from_usage=usage_tokens is not None)


async def _one(client: httpx.AsyncClient, spec: LoadSpec, prompt: str) -> RequestResult:
    """Send one request; never raises (except on cancellation): failures become error records."""
    path, body = _body(spec, prompt)
    headers = _headers(spec.api_key)
    t0 = time.perf_counter()
    try:
        if spec.stream:
            return await _stream(client, path, body, headers, t0)
        resp = await client.post(path, json=body, headers=headers)
        latency = time.perf_counter() - t0
        if resp.status_code != 200:
            return RequestResult(False, latency, error=_error_text(resp.status_code, resp.content))
        tokens = (resp.json().get("usage") or {}).get("completion_tokens")
        return RequestResult(True, latency, latency, tokens or 0, tokens_from_usage=tokens is not None)
    except Exception as exc:  # a load generator reports every failure instead of stopping
        return RequestResult(False, time.perf_counter() - t0, error=f"{type(exc).__name__}: {str(exc)[:160]}")


def _client(base_url: str, connections: int, timeout: float) -> httpx.AsyncClient:
    # http/1.1 with one pooled connection per client and no retries, like a fleet of simple clients;
    # trust_env=False so a proxy from the environment never sits between us and the server.
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    transport = httpx.AsyncHTTPTransport(retries=0, limits=limits)
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        transport=transport,
        timeout=httpx.Timeout(timeout, connect=10.0),
        trust_env=False,
    )


async def run_load(spec: LoadSpec) -> LoadResult:
    """Run `spec` and aggregate it. Errors are counted and reported in the result, never raised."""
    if spec.concurrency < 1 or spec.num_requests < 1 or not spec.prompts:
        raise ConfigError("a load needs concurrency ≥ 1, num_requests ≥ 1 and at least one prompt")
    workers = min(spec.concurrency, spec.num_requests)
    records: list[RequestResult] = []
    async with _client(spec.base_url, workers, spec.timeout) as client:
        for i in range(spec.warmup):
            await _one(client, spec, spec.prompt(i))
        counter = itertools.count()  # shared by the workers; asyncio runs one at a time, so next() is safe

        async def worker() -> None:
            while (i := next(counter)) < spec.num_requests:
                records.append(await _one(client, spec, spec.prompt(spec.warmup + i)))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workers)))
        wall = time.perf_counter() - t0
    return summarize(records, wall, spec.concurrency)


async def wait_ready(base_url: str, timeout: float = 60.0, api_key: str | None = None) -> str | None:
    """Wait until the server at `base_url` serves; return its first model id (None if it lists none).

    Ready means GET /ready answers 200 (quantserve), or /ready is unknown and GET /v1/models answers 200
    (llama-cpp-python's server, llama.cpp's llama-server, which answer 503 while loading).

    Raises:
        ServerUnreachableError: nothing answered that way within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    async with _client(base_url, 1, 5.0) as client:
        while True:
            try:
                ready = await client.get("/ready", headers=_headers(api_key))
                models = await client.get("/v1/models", headers=_headers(api_key))
                if ready.status_code in (200, 404) and models.status_code == 200:
                    data = models.json().get("data") or []
                    return data[0].get("id") if data else None
                last = f"/ready {ready.status_code}, /v1/models {models.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerUnreachableError(
                    f"no OpenAI-compatible server was ready at {base_url} within {timeout:.0f} s ({last}); "
                    "start one (e.g. `quantserve run smollm2 --port 8000`) or pass the right --url"
                )
            await asyncio.sleep(0.25)


def load_prompts(path: str | Path) -> tuple[str, ...]:
    """Prompts from a text file (one per line) or JSONL (`{"prompt": ...}` per line); blank lines skipped.

    Raises:
        ConfigError: the file is missing, empty, or a JSONL line has no "prompt".
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompt file {p} does not exist; pass a text file (one prompt a line) or JSONL")
    prompts: list[str] = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl" or line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f'{p}:{n}: expected a JSON object with a "prompt" field ({exc})') from exc
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"prompt file {p} holds no prompts")
    return tuple(prompts)


def synthetic_prompts(num_words: int, count: int) -> tuple[str, ...]:
    """`count` distinct prompts of about `num_words` words, for prefill-heavy loads.

    Each starts with its own number so no server can reuse another request's prompt from its prefix cache.
    """
    filler = _FILLER.split()
    body = " ".join(filler[i % len(filler)] for i in range(max(num_words - 12, 1)))
    return tuple(f"Document {i}. Summarize the following text in detail. {body}" for i in range(count))
