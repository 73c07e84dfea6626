"""Reporting for quantserve.cli.loadgen: markdown tables of LoadResults and ratios between two servers."""

from __future__ import annotations

from quantserve.cli.loadgen import LoadResult


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
