"""quantserve.cli.loadgen and `quantserve bench` against a tiny in-process fake OpenAI server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantserve.cli.bench import bench
from quantserve.cli.loadgen import (
    LoadSpec,
    ServerUnreachableError,
    load_prompts,
    run_load,
    synthetic_prompts,
    wait_ready,
)
from quantserve.cli.loadgen_report import (
    LoadResult,
    RequestResult,
    percentile,
    ratios,
    render_ratio,
    render_table,
    summarize,
)
from tests.conftest import free_port

TOKEN_DELAY_S = 0.002
RECEIVED: list[str] = []  # every prompt the fake server got, in arrival order


def _fake_app() -> FastAPI:
    """Streams max_tokens one-word chunks. Switches: a prompt containing FAIL gets a 503; model
    "no-usage" never sends usage (like llama-cpp-python's server), so tokens must be counted from chunks;
    model "no-done" ends its streams without [DONE], like a server that died mid-answer."""
    app = FastAPI()

    @app.get("/ready")
    async def ready():
        return {"status": "ready"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def generate(request: Request, chat: bool):
        body = await request.json()
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        RECEIVED.append(prompt)
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "the server is overloaded"}}, status_code=503)
        n = body.get("max_tokens") or 16
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        if not body.get("stream"):
            await asyncio.sleep(TOKEN_DELAY_S * n)
            msg = {"message": {"role": "assistant", "content": "tok " * n}} if chat else {"text": "tok " * n}
            return {"choices": [{"index": 0, **msg, "finish_reason": "length"}], "usage": usage}
        include_usage = (body.get("stream_options") or {}).get("include_usage") and body.get(
            "model"
        ) != "no-usage"

        async def events():
            if chat:  # the role-only first chunk carries no content and must not count as the first token
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
            yield ": ping\n\n"
            for _ in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if include_usage:
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            if body.get("model") != "no-done":
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    return app


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def _run(**kw) -> LoadResult:
    return asyncio.run(run_load(LoadSpec(**kw)))


def test_percentile_known_values():
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)  # numpy's linear: 1 + 0.95 * 4 ranks
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([10, 20], 0) == 10 and percentile([10, 20], 100) == 20


def test_summarize_known_records():
    records = [
        RequestResult(True, latency_s=1.0, ttft_s=0.1, output_tokens=10, tokens_from_usage=True),
        RequestResult(True, latency_s=2.0, ttft_s=0.2, output_tokens=10, tokens_from_usage=True),
        RequestResult(False, latency_s=0.01, error="HTTP 503: busy"),
        RequestResult(False, latency_s=0.01, error="HTTP 503: busy"),
    ]
    r = summarize(records, wall_s=4.0, concurrency=2)
    assert (r.num_requests, r.num_ok, r.num_errors) == (4, 2, 2)
    assert r.errors == ("HTTP 503: busy (x2)",)
    assert r.output_tokens == 20 and r.agg_tok_s == pytest.approx(5.0) and r.token_source == "usage"
    assert r.ttft_p50_ms == pytest.approx(150.0)
    assert r.tpot_p50_ms == pytest.approx(((0.9 / 9) + (1.8 / 9)) / 2 * 1e3)
    assert r.latency_mean_s == pytest.approx(1.5)
    assert "requests" not in r.to_dict() and len(r.to_dict(include_requests=True)["requests"]) == 4
    json.dumps(r.to_dict(include_requests=True))


def test_ratios_and_render():
    a = summarize([RequestResult(True, 1.0, 0.1, 11, True)], wall_s=1.0, concurrency=4)
    b = summarize([RequestResult(True, 2.0, 0.4, 11, True)], wall_s=2.0, concurrency=4)
    r = ratios(a, b)
    assert r["agg_tok_s"] == pytest.approx(2.0)  # 11 tok/s over 5.5 tok/s
    assert r["ttft_p50_ms"] == pytest.approx(0.25)
    assert r["tpot_p50_ms"] == pytest.approx((0.9 / 10) / (1.6 / 10))
    assert r["latency_p50_s"] == pytest.approx(0.5)
    empty = summarize([RequestResult(False, 0.1, error="x")], wall_s=1.0, concurrency=4)
    assert ratios(a, empty)["agg_tok_s"] is None and ratios(a, empty)["ttft_p50_ms"] is None
    assert "tok/s x2.00" in render_ratio(a, b)
    table = render_table([("ours", a), ("peer", b)])
    assert table.count("\n") == 3 and "| ours | 4 |" in table


def test_stream_chat_counts_usage_tokens(fake_url):
    r = _run(base_url=fake_url, concurrency=2, num_requests=4, max_tokens=5, warmup=1)
    assert (r.num_ok, r.num_errors, r.output_tokens, r.token_source) == (4, 0, 20, "usage")
    for req in r.requests:
        assert req.ttft_s is not None and 0 < req.ttft_s < req.latency_s and req.tpot_s is not None
    assert r.agg_tok_s > 0 and r.ttft_p50_ms is not None and r.tpot_p95_ms is not None


def test_stream_without_usage_counts_chunks(fake_url):
    r = _run(
        base_url=fake_url,
        concurrency=1,
        num_requests=2,
        max_tokens=6,
        endpoint="completions",
        model="no-usage",
    )
    assert (r.num_ok, r.output_tokens, r.token_source) == (2, 12, "chunks")


def test_non_stream_ttft_is_latency(fake_url):
    r = _run(base_url=fake_url, concurrency=2, num_requests=2, max_tokens=4, stream=False)
    assert r.num_ok == 2 and r.output_tokens == 8
    assert all(req.ttft_s == req.latency_s and req.tpot_s is None for req in r.requests)
    assert r.tpot_p50_ms is None


def test_errors_are_counted_not_raised(fake_url):
    r = _run(base_url=fake_url, concurrency=3, num_requests=6, max_tokens=3, prompts=("hello", "FAIL please"))
    assert (r.num_ok, r.num_errors, r.output_tokens) == (3, 3, 9)
    assert r.errors == ("HTTP 503: the server is overloaded (x3)",)


def test_stream_without_done_is_an_error(fake_url):
    r = _run(base_url=fake_url, concurrency=1, num_requests=2, max_tokens=3, model="no-done")
    assert (r.num_ok, r.num_errors, r.output_tokens) == (0, 2, 0)
    assert r.errors == ("the stream ended without data: [DONE] (x2)",)


def test_a_tag_makes_every_prompt_distinct_warmup_included(fake_url):
    RECEIVED.clear()
    r = _run(
        base_url=fake_url,
        concurrency=2,
        num_requests=5,
        max_tokens=2,
        prompts=("a", "b"),
        warmup=1,
        tag="x.0",
    )
    assert r.num_ok == 5
    assert sorted(RECEIVED) == sorted(f"[x.0.{k}] {'ab'[k % 2]}" for k in range(6))
    RECEIVED.clear()
    _run(base_url=fake_url, concurrency=1, num_requests=3, max_tokens=2, prompts=("a", "b"))
    assert RECEIVED == ["a", "b", "a"]  # untagged (prompt files): sent as written


def test_unreachable_server_gives_errors_and_wait_ready_raises():
    url = f"http://127.0.0.1:{free_port()}"
    r = _run(base_url=url, concurrency=2, num_requests=2, max_tokens=3, timeout=2.0)
    assert r.num_errors == 2 and r.errors[0].startswith("ConnectError")
    with pytest.raises(ServerUnreachableError, match="--url"):
        asyncio.run(wait_ready(url, timeout=0.3))


def test_prompt_files_and_synthetic_prompts(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "id": 2}\n')
    assert load_prompts(tmp_path / "p.txt") == ("first prompt", "second prompt")
    assert load_prompts(tmp_path / "p.jsonl") == ("a", "b")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(Exception, match='"prompt"'):
        load_prompts(tmp_path / "bad.jsonl")
    prompts = synthetic_prompts(200, 3)
    assert len(set(prompts)) == 3 and all(190 <= len(p.split()) <= 210 for p in prompts)


def test_bench_command_compare_writes_json(fake_url, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--url", fake_url, "--compare", fake_url, "-c", "1", "-c", "2", "-n", "3", "--max-tokens", "4"]
    result = CliRunner().invoke(bench, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert (
        "| ours | 1 |" in result.output and "| peer | 2 |" in result.output and "ours/peer" in result.output
    )
    doc = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"]) for r in doc["runs"]] == [
        ("ours", 1),
        ("ours", 2),
        ("peer", 1),
        ("peer", 2),
    ]
    assert all(r["model"] == "fake-model" and r["output_tokens"] == 12 for r in doc["runs"])
    assert [x["concurrency"] for x in doc["ratios"]] == [1, 2]


def test_bench_command_unreachable_exits_2():
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(bench, ["--url", url, "--ready-timeout", "0.3"])
    assert result.exit_code == 2 and "no OpenAI-compatible server" in result.output
