"""Markdown and JSON reports of bench/serving.py: summary, ratios against each peer, detail, every round."""

from __future__ import annotations

import json
from pathlib import Path

from quantserve.cli.loadgen_report import LoadResult, ratios, render_table

QUANTSERVE = "quantserve"  # every server whose name starts with this is ours; the others are peers


def median_runs(all_runs: list[dict[str, list[LoadResult]]]) -> dict[str, list[LoadResult]]:
    """Per server and level, the round with the median tok/s (a whole measurement, not a mix of medians); with an
    even number of rounds, the slower of the two middle ones."""
    out: dict[str, list[LoadResult]] = {}
    for name in all_runs[0]:
        per_level = zip(*(runs[name] for runs in all_runs if name in runs), strict=True)
        out[name] = [sorted(rs, key=lambda r: r.agg_tok_s)[(len(rs) - 1) // 2] for rs in per_level]
    return out


def summary_md(runs: dict[str, list[LoadResult]]) -> str:
    lines = [
        "| server | conc | tok/s | tok/req | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, results in runs.items():
        for r in results:
            f = [r.ttft_p50_ms, r.ttft_p95_ms, r.tpot_p50_ms]
            ms = ["-" if x is None else f"{x:.0f}" if i < 2 else f"{x:.1f}" for i, x in enumerate(f)]
            lines.append(
                f"| {name} | {r.concurrency} | {r.agg_tok_s:.1f} | {r.mean_output_tokens:.1f} | "
                f"{' | '.join(ms)} | {r.num_errors} |"
            )
    return "\n".join(lines)


def ratio_md(runs: dict[str, list[LoadResult]]) -> tuple[str, list[dict]]:
    ours_names = [n for n in runs if n.startswith(QUANTSERVE)]
    peers = [n for n in runs if not n.startswith(QUANTSERVE)]
    if not ours_names or not peers:
        return "(needs quantserve and a peer)", []
    head = (
        "| quantserve | conc | "
        + " | ".join(f"tok/s vs {p} | TTFT p50 vs {p} | TPOT p50 vs {p}" for p in peers)
        + " |"
    )
    lines = [head, "|---|---|" + "---|---|---|" * len(peers)]
    rows = []
    for name in ours_names:
        for i, ours in enumerate(runs[name]):
            cells = []
            for p in peers:
                r = ratios(ours, runs[p][i])
                rows.append({"quantserve": name, "concurrency": ours.concurrency, "peer": p, **r})
                cells += [
                    "-" if r[k] is None else f"x{r[k]:.2f}"
                    for k in ("agg_tok_s", "ttft_p50_ms", "tpot_p50_ms")
                ]
            lines.append(f"| {name} | {ours.concurrency} | " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


def rounds_md(all_runs: list[dict[str, list[LoadResult]]]) -> str:
    n = len(all_runs)
    lines = [
        "| server | conc | " + " | ".join(f"round {k + 1}" for k in range(n)) + " | spread |",
        "|---|---|" + "---|" * (n + 1),
    ]
    for name in all_runs[0]:
        for i, r0 in enumerate(all_runs[0][name]):
            per_round = [runs[name][i].agg_tok_s if name in runs else None for runs in all_runs]
            toks = [t for t in per_round if t is not None]  # a server that failed to start in a later round
            spread = (max(toks) - min(toks)) / (sorted(toks)[(len(toks) - 1) // 2] or 1)
            cells = " | ".join("-" if t is None else f"{t:.1f}" for t in per_round)
            lines.append(f"| {name} | {r0.concurrency} | {cells} | {100 * spread:.0f} % |")
    return "\n".join(lines)


def write_report(stem: Path, info: dict, all_runs: list[dict[str, list[LoadResult]]]) -> None:
    runs = median_runs(all_runs)
    summary = summary_md(runs)
    ratio_table, ratio_rows = ratio_md(runs)
    detail = render_table([(name, r) for name, rs in runs.items() for r in rs])
    print(
        f"{summary}\n\nquantserve / peer (tok/s: higher is better; TTFT, TPOT: lower is better)\n\n{ratio_table}"
    )
    m, mod, st = info["machine"], info["model"], info["settings"]
    server_lines = "\n".join(
        f"- {n}: `{d['cmd']}`"
        + ("" if d["ignore_eos"] else " (no ignore_eos: outputs may end early)")
        + (f" **FAILED: {info['failed'][n]}**" if n in info["failed"] else "")
        for n, d in info["servers"].items()
    )
    md = f"""# Serving benchmark, {info["date"]}

- machine: {m["cpu"]} ({" ".join(m["isa"])}), {m["cores"]} cores, {m["ram_gib"]} GiB RAM, {m["platform"]}
- model: `{mod["path"]}` ({mod["size_bytes"] / 2**20:.1f} MiB)
- versions: {", ".join(f"{k} {v}" for k, v in info["versions"].items())}
- load: chat, stream, temperature 0, {st["max_tokens"]} max tokens, 1 warmup request per level,
  requests per level (concurrency: requests) {st["num_requests"]}; tok/s = output tokens / wall time;
  no prompt repeats within a server's life (each request's starts with its own "[c8.12]" tag)
- {len(all_runs)} rounds, servers in turn, one at a time; every row below is the round with the median tok/s
- command: `{info["command"]}`

{server_lines}

## Summary

{summary}

## quantserve / peer

tok/s: higher is better; TTFT and TPOT: lower is better.

{ratio_table}

## Detail

{detail}

## tok/s in every round

{rounds_md(all_runs)}
"""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(md)
    doc = {
        **info,
        "results": {n: [r.to_dict() for r in rs] for n, rs in runs.items()},
        "ratios": ratio_rows,
        "rounds": [{n: [r.to_dict() for r in rs] for n, rs in runs_k.items()} for runs_k in all_runs],
    }
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
