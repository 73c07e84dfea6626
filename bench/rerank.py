"""What batching saves in /v1/rerank: one request with 32 documents against the same 32 documents sent as 32
single-document requests one after another, on the same server, in one run, for both backends (SmolLM2 as a
yes/no judge: the Q4_1 GGUF on llama.cpp, the fp32 HF checkpoint on torch).

Usage: .venv/bin/python bench/rerank.py [--rounds 3] [--threads 2] [--documents 32] [--cross-encoder GGUF]
Writes bench/results/rerank-<date>.md and .json.

--cross-encoder adds a reranker GGUF (a classification head, llama.cpp's rank pooling) as a third server.
`--cross-encoder tiny` builds a random RoBERTa cross-encoder of SmolLM2's width (576, 6 layers) with
tests/backends/llamacpp/test_rerank_gguf.py's recipe and converts it with llama.cpp's convert_hf_to_gguf.py (from
the sdist that `make test` extracts), to time the batching where no real reranker is at hand.

Each round has its own query, and the two ways get it tagged differently, so neither starts with anything of its
prompts cached (not the other's prompts either); within a round both get the same prefix-cache help (the first
document computes the instruction and the query, the rest reuse them), and they alternate which goes first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from constrained import hf_checkpoint  # noqa: E402
from serving import ServerDef, free_port, machine_info, save_record, start, stop, versions, wait_serving  # noqa: E402

from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

SENTENCES = [
    s.strip() + "." for s in (files("quantserve") / "data/eval.txt").read_text().split(".") if len(s) > 60
]
QUERIES = [
    "What is the history of the city?",
    "How does the process work?",
    "Who wrote about this subject?",
    "When did the events take place?",
    "Why did it change over time?",
]


def rerank(url: str, query: str, documents: list[str]) -> dict:
    r = httpx.post(url + "/v1/rerank", json={"query": query, "documents": documents}, timeout=600)
    r.raise_for_status()
    return r.json()


def one_round(url: str, query: str, documents: list[str], batched_first: bool) -> tuple[float, float, int]:
    """Seconds for the batched request and for the singles, and the prompt tokens of either."""

    def batched() -> tuple[float, int]:
        t = time.perf_counter()
        body = rerank(url, f"(b) {query}", documents)
        return time.perf_counter() - t, body["usage"]["prompt_tokens"]

    def singles() -> float:
        t = time.perf_counter()
        for d in documents:
            rerank(url, f"(s) {query}", [d])
        return time.perf_counter() - t

    if batched_first:
        (tb, n), ts = batched(), singles()
    else:
        ts = singles()
        tb, n = batched()
    return tb, ts, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--documents", type=int, default=32)
    ap.add_argument("--seqs", type=int, default=8, help="--max-num-seqs of the servers")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    ap.add_argument("--cross-encoder", help="a reranker GGUF, or `tiny` (see above)")
    args = ap.parse_args()
    gguf = resolve("smollm2", load_registry(find_models_toml(None))).path
    sources = {"llamacpp": gguf, "torch": hf_checkpoint(gguf)}
    if args.cross_encoder == "tiny":
        sources["cross-encoder"] = tiny_cross_encoder(gguf)
    elif args.cross_encoder:
        sources["cross-encoder"] = Path(args.cross_encoder)
    docs = SENTENCES[: args.documents]
    assert len(docs) == args.documents, f"only {len(docs)} sentences in eval.txt"
    rows: dict[str, list[tuple[float, float, int]]] = {}
    logs = Path(tempfile.mkdtemp(prefix="qs-rerank-"))
    for backend, src in sources.items():
        port = free_port()
        engine = "llamacpp" if backend == "cross-encoder" else backend
        cmd = (sys.executable, "-m", "quantserve.cli", "run", str(src), "--backend", engine, "--threads",
               str(args.threads), "--max-num-seqs", str(args.seqs), "--ctx-size", "2048", "--port", str(port),
               "--log-level", "warning")  # fmt: skip
        sd = ServerDef(backend, cmd, port, ignore_eos=True)
        log = logs / f"{backend}.log"
        proc = start(sd, log)
        try:
            wait_serving(sd, proc, log, 300)
            url = f"http://127.0.0.1:{port}"
            rerank(url, "warm up", docs[:2])
            for rnd in range(args.rounds):
                query = f"[{rnd}] {QUERIES[rnd % len(QUERIES)]}"
                tb, ts, n = one_round(url, query, docs, batched_first=rnd % 2 == 0)
                rows.setdefault(backend, []).append((tb, ts, n))
                print(
                    f"{backend:9s} round {rnd}: batched {tb:.2f} s, singles {ts:.2f} s ({n} tokens)",
                    flush=True,
                )
        finally:
            stop(proc)
    write(args, rows)


def tiny_cross_encoder(smollm2_gguf: Path) -> Path:
    """--cross-encoder tiny: the random RoBERTa cross-encoder as an F32 GGUF written by llama.cpp's converter."""
    import os
    import subprocess

    from quantserve.converters import gguf_to_hf
    from tests.backends.llamacpp.test_rerank_gguf import build_cross_encoder

    converter = ROOT / "bench/.build/src/vendor/llama.cpp/convert_hf_to_gguf.py"
    if not converter.is_file():
        sys.exit(
            f"{converter} is missing: run tests/backends/llamacpp/test_rerank_gguf.py once, which extracts it from "
            "the sdist"
        )
    tmp = Path(tempfile.mkdtemp(prefix="qs-xenc-"))
    hf = gguf_to_hf(smollm2_gguf, tmp / "smollm2-hf", dtype="fp32", progress=False)
    src = build_cross_encoder(tmp / "cross-encoder", hf, hidden=576, layers=6, positions=512)
    (tmp / "shim").mkdir()  # the converter imports sentencepiece before finding no SentencePiece model
    (tmp / "shim/sentencepiece.py").write_text("class SentencePieceProcessor: ...\n")
    out = tmp / "cross-encoder-f32.gguf"
    env = {**os.environ, "PYTHONPATH": str(tmp / "shim"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(converter), str(src), "--outfile", str(out), "--outtype", "f32"]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return out


def write(args, rows: dict[str, list[tuple[float, float, int]]]) -> None:
    stamp = dt.datetime.now(dt.UTC)
    name = f"rerank-{stamp:%Y-%m-%d}"
    info = machine_info()
    lines = [
        f"# /v1/rerank: {args.documents} documents in one request against {args.documents} single requests",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/rerank.py --rounds {args.rounds} "
        f"--threads {args.threads} --documents {args.documents} --seqs {args.seqs}"
        + (f" --cross-encoder {args.cross_encoder}" if args.cross_encoder else "")
        + "`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(None).items()),
        "",
        "SmolLM2-135M-Instruct as a yes/no judge (quantserve.rerank): the Q4_1 GGUF on llama.cpp, the fp32 HF "
        f"checkpoint on torch (CPU); `--max-num-seqs {args.seqs} --ctx-size 2048`. "
        + (f"cross-encoder: {args.cross_encoder} on llama.cpp's rank pooling. " if args.cross_encoder else "")
        + (
            "(tiny: a random RoBERTa of SmolLM2's vocabulary and width, 576 x 6 layers, 512 positions, F32.) "
            if args.cross_encoder == "tiny"
            else ""
        )  # fmt: skip
        + "Documents: the first "
        f"{args.documents} sentences over 60 characters of quantserve/data/eval.txt. Each round has a query of its "
        "own, tagged apart for the two ways so neither reads the other's prompts from the prefix cache; the batched "
        "request and the singles alternate which goes first. Wall time at the client, median of "
        "the rounds.",
        "",
        "| backend | one request, all documents | one request per document | ratio (batched / singles) |",
        "|---|---|---|---|",
    ]
    medians = {}
    for backend, rs in rows.items():
        tb, ts = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        medians[backend] = {"batched_s": tb, "singles_s": ts, "ratio": tb / ts}
        lines.append(f"| {backend} | {tb:.2f} s | {ts:.2f} s | **{tb / ts:.3f}** |")
    lines += ["", "Every round (batched s, singles s, prompt tokens):", ""]
    lines += [f"- {k}: " + "; ".join(f"{a:.2f}, {b:.2f}, {n}" for a, b, n in v) for k, v in rows.items()]
    save_record(args.out, name, lines, {"machine": info, "rounds": rows, "median": medians})


if __name__ == "__main__":
    main()
