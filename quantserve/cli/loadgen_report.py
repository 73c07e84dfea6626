"""The results of a load run (quantserve.cli.loadgen): per-request records, their summary (tok/s, TTFT/TPOT and
latency percentiles), markdown tables and ratios between two servers."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_ERRORS = 20  # distinct error strings kept in a LoadResult; the count covers all of them


@dataclass(frozen=True)
class RequestResult:
    """One request. Times in seconds from sending it; `ttft_s` is None when no content arrived."""

    ok: bool
    latency_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    tokens_from_usage: bool = False
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2 or self.ttft_s >= self.latency_s:
            return None  # non-stream requests have TTFT == latency: no per-token time to measure
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadResult:
    """Aggregates of one run. Times: TTFT/TPOT in ms, latency in s; None where nothing was measured."""

    concurrency: int
    num_requests: int
    num_ok: int
    num_errors: int
    errors: tuple[str, ...]
    wall_s: float
    output_tokens: int
    agg_tok_s: float
    mean_output_tokens: float
    token_source: str  # "usage", "chunks" (streams without usage: one chunk per token) or "mixed"
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_mean_s: float | None
    requests: tuple[RequestResult, ...] = field(default=(), repr=False)

    def to_dict(self, include_requests: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["errors"] = list(self.errors)
        if include_requests:
            d["requests"] = [{**asdict(r), "tpot_s": r.tpot_s} for r in self.requests]
        else:
            del d["requests"]
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100) with linear interpolation between ranks, as numpy's default; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _scaled(x: float | None, k: float) -> float | None:
    return None if x is None else x * k


def summarize(records: Sequence[RequestResult], wall_s: float, concurrency: int) -> LoadResult:
    """Aggregate request records; tokens of failed requests do not count towards tok/s."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    lat = [r.latency_s for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    sources = {r.tokens_from_usage for r in ok}
    source = "mixed" if len(sources) > 1 else ("usage" if sources == {True} else "chunks")
    errors = Counter(r.error or "unknown error" for r in records if not r.ok)
    return LoadResult(
        concurrency=concurrency,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        errors=tuple(f"{msg} (x{n})" if n > 1 else msg for msg, n in errors.most_common(MAX_ERRORS)),
        wall_s=wall_s,
        output_tokens=tokens,
        agg_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        mean_output_tokens=tokens / len(ok) if ok else 0.0,
        token_source=source if ok else "none",
        ttft_p50_ms=_scaled(percentile(ttft, 50), 1e3),
        ttft_p95_ms=_scaled(percentile(ttft, 95), 1e3),
        tpot_p50_ms=_scaled(percentile(tpot, 50), 1e3),
        tpot_p95_ms=_scaled(percentile(tpot, 95), 1e3),
        latency_p50_s=percentile(lat, 50),
        latency_p95_s=percentile(lat, 95),
        latency_mean_s=sum(lat) / len(lat) if lat else None,
        requests=tuple(records),
    )


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_table(results: list[tuple[str, LoadResult]]) -> str:
    """A markdown table, one row per (label, result)."""
    head = (
        "| server | conc | ok/err | out tok | tok/req | wall s | tok/s | TTFT p50 ms | TTFT p95 ms "
        "| TPOT p50 ms | TPOT p95 ms | lat p50 s | lat p95 s |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, r in results:
        rows.append(
            f"| {label} | {r.concurrency} | {r.num_ok}/{r.num_errors} | {r.output_tokens} "
            f"| {r.mean_output_tokens:.1f} | {r.wall_s:.2f} | {r.agg_tok_s:.1f} "
            f"| {_fmt(r.ttft_p50_ms, '.0f')} | {_fmt(r.ttft_p95_ms, '.0f')} "
            f"| {_fmt(r.tpot_p50_ms, '.1f')} | {_fmt(r.tpot_p95_ms, '.1f')} "
            f"| {_fmt(r.latency_p50_s, '.2f')} | {_fmt(r.latency_p95_s, '.2f')} |"
        )
    return "\n".join(rows)


def ratios(a: LoadResult, b: LoadResult) -> dict[str, float | None]:
    """a/b for throughput and the median times; None where either side has no value or b's is 0."""

    def div(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None or y == 0 else x / y

    return {
        "agg_tok_s": div(a.agg_tok_s, b.agg_tok_s),
        "ttft_p50_ms": div(a.ttft_p50_ms, b.ttft_p50_ms),
        "tpot_p50_ms": div(a.tpot_p50_ms, b.tpot_p50_ms),
        "latency_p50_s": div(a.latency_p50_s, b.latency_p50_s),
    }


def render_ratio(a: LoadResult, b: LoadResult) -> str:
    """One line: a/b ratios at a's concurrency (above 1 is better for tok/s, below 1 for times)."""
    r = ratios(a, b)
    return (
        f"c={a.concurrency}: tok/s x{_fmt(r['agg_tok_s'], '.2f')} (higher is better), "
        f"TTFT p50 x{_fmt(r['ttft_p50_ms'], '.2f')}, TPOT p50 x{_fmt(r['tpot_p50_ms'], '.2f')}, "
        f"latency p50 x{_fmt(r['latency_p50_s'], '.2f')} (lower is better)"
    )
