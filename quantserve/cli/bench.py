"""The `quantserve bench` command: measure an OpenAI-compatible server under load, optionally against a peer."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import sys
from pathlib import Path

import click

from quantserve.errors import ConfigError

EXIT_UNREACHABLE = 2


@click.command("bench")
@click.option(
    "--url", default="http://127.0.0.1:8000", show_default=True, help="base URL of the server to load"
)
@click.option(
    "--model", default=None, help="model id to request from --url (default: the first in /v1/models)"
)
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(min=1),
    multiple=True,
    default=(1,),
    show_default=True,
    help="clients sending at once; repeat to sweep (-c 1 -c 4 -c 8)",
)
@click.option(
    "-n",
    "--num-requests",
    type=click.IntRange(min=1),
    default=None,
    help="requests per concurrency level [default: max(8, 4 x concurrency)]",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False),
    help="text (one a line) or JSONL file, sent as written (default: built-in prompts, each request's tagged "
    "'[run.level.k]' so no server can answer one from its prompt cache)",
)
@click.option(
    "--prompt-len",
    type=click.IntRange(min=1),
    default=None,
    help="synthetic prompts of ~N words (tagged too)",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--stream/--no-stream", default=True, show_default=True)
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True)
@click.option(
    "--ignore-eos/--no-ignore-eos",
    default=True,
    show_default=True,
    help="ask the server to generate exactly --max-tokens (servers that do not know the field ignore it)",
)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' to both servers")
@click.option(
    "--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="untimed requests first"
)
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds per request")
@click.option(
    "--ready-timeout", type=float, default=60.0, show_default=True, help="seconds to wait for /ready"
)
@click.option(
    "--compare", "compare_url", default=None, help="base URL of a peer server to run the same load on"
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write all results here"
)
def bench(
    url: str,
    model: str | None,
    concurrency: tuple[int, ...],
    num_requests: int | None,
    prompts_file: str | None,
    prompt_len: int | None,
    max_tokens: int,
    stream: bool,
    endpoint: str,
    ignore_eos: bool,
    temperature: float,
    api_key: str | None,
    warmup: int,
    timeout: float,
    ready_timeout: float,
    compare_url: str | None,
    json_path: str | None,
) -> None:
    """Load an OpenAI-compatible server and report tok/s, TTFT, TPOT and latency percentiles.

    \b
    Examples:
      quantserve bench -c 1 -c 4 -c 8 --max-tokens 128
      quantserve bench --url http://127.0.0.1:8000 --compare http://127.0.0.1:8001 --json out.json
      quantserve bench --prompt-len 1000 --max-tokens 16 -c 4     # prefill-heavy
    """
    from quantserve.cli import loadgen as lg
    from quantserve.cli import loadgen_report as report

    if prompts_file and prompt_len:
        raise click.UsageError("pass either --prompts or --prompt-len, not both")

    targets = [("ours", url)] + ([("peer", compare_url)] if compare_url else [])
    models: dict[str, str | None] = {}
    for label, base in targets:
        try:
            found = asyncio.run(lg.wait_ready(base, ready_timeout, api_key))
        except lg.ServerUnreachableError as exc:
            click.echo(f"error: {exc.message}", err=True)
            sys.exit(EXIT_UNREACHABLE)
        # --model names ours only: the peer may call the same file something else.
        models[label] = model if (model and label == "ours") else found

    def n_for(c: int) -> int:
        return num_requests or max(8, 4 * c)

    try:
        if prompts_file:
            prompts = lg.load_prompts(prompts_file)
        elif prompt_len:
            prompts = lg.synthetic_prompts(prompt_len, warmup + max(n_for(c) for c in concurrency))
        else:
            prompts = lg.DEFAULT_PROMPTS
    except ConfigError as exc:
        raise click.BadParameter(exc.message) from exc

    # Built-in and synthetic prompts get a tag per run and level, so no request repeats an earlier prompt (a
    # server's prompt cache would otherwise answer it); prompts from a file are sent exactly as written.
    run_id = None if prompts_file else secrets.token_hex(2)
    results: dict[str, list] = {label: [] for label, _ in targets}
    rank_seconds: dict[str, dict[str, float]] = {}
    for label, base in targets:
        before = _rank_seconds(base, api_key)
        for level, c in enumerate(concurrency):
            spec = lg.LoadSpec(
                base_url=base,
                concurrency=c,
                num_requests=n_for(c),
                prompts=prompts,
                max_tokens=max_tokens,
                stream=stream,
                endpoint=endpoint,
                ignore_eos=ignore_eos,
                model=models[label],
                temperature=temperature,
                api_key=api_key,
                timeout=timeout,
                warmup=warmup,
                tag=run_id and f"{run_id}.{level}",
            )
            click.echo(
                f"{label} {base}: c={c}, {spec.num_requests} requests, {max_tokens} max tokens …", err=True
            )
            results[label].append(asyncio.run(lg.run_load(spec)))
        after = _rank_seconds(base, api_key)
        if after:
            rank_seconds[label] = {r: after[r] - before.get(r, 0.0) for r in after}

    click.echo(report.render_table([(label, r) for label, _ in targets for r in results[label]]))
    for label, per_rank in rank_seconds.items():
        click.echo(
            f"{label}: tensor-parallel step time in the run, per rank: "
            + ", ".join(f"rank {r} {t:.2f} s" for r, t in sorted(per_rank.items()))
        )
    for label, _ in targets:
        for r in results[label]:
            for err in r.errors:
                click.echo(f"{label} c={r.concurrency} error: {err}", err=True)
    if compare_url:
        click.echo("\nours/peer:")
        for a, b in zip(results["ours"], results["peer"], strict=True):
            click.echo("  " + report.render_ratio(a, b))

    if json_path:
        doc = {
            "settings": {
                "concurrency": list(concurrency),
                "num_requests": [n_for(c) for c in concurrency],
                "max_tokens": max_tokens,
                "stream": stream,
                "endpoint": endpoint,
                "ignore_eos": ignore_eos,
                "temperature": temperature,
                "warmup": warmup,
                "prompts": prompts_file or (f"synthetic:{prompt_len}" if prompt_len else "builtin"),
                "prompt_tag": run_id,  # request k of level i starts "[prompt_tag.i.k] "; null: sent as written
            },
            "runs": [
                {"server": label, "url": base, "model": models[label], **r.to_dict(include_requests=True)}
                for label, base in targets
                for r in results[label]
            ],
            "rank_step_seconds": rank_seconds,
            "ratios": [
                {"concurrency": a.concurrency, **report.ratios(a, b)}
                for a, b in zip(results["ours"], results.get("peer", []), strict=False)
            ],
        }
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)


_RANK_TOTAL = re.compile(r'^quantserve_rank_step_seconds_total\{[^}]*rank="(\d+)"[^}]*\} ([0-9.e+-]+)$', re.M)


def _rank_seconds(base: str, api_key: str | None) -> dict[str, float]:
    """Each tensor-parallel rank's time in engine steps so far, from the server's /metrics (empty: one process, or
    a server that is not quantserve)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(base.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    return {rank: float(v) for rank, v in _RANK_TOTAL.findall(text)}
