"""A mutation fuzzer over a GGUF's header and metadata: each mutant is validated and then loaded by llama.cpp in a
child process, exactly as the server loads a model; a child killed by a signal (llama.cpp aborting) is a finding.

Usage: .venv/bin/python bench/gguf_fuzz.py [--mutations 200] [--seed 7] [--model smollm2]
Writes bench/results/gguf-fuzz-<date>.md and .json.

Mutations, in turn: a random byte anywhere before the tensor data; a byte inside the vocabulary's strings (where
equal tokens and bad lengths come from); a whole token overwritten with another of the same length (a repeated
token, which llama.cpp asserts against); a u64 length or count set to 0, 1, 2^40 or all ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import machine_info, save_record, versions  # noqa: E402

from quantserve.formats import read_gguf_info  # noqa: E402
from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

# Validate, then load with llama.cpp as the server does; exit 2 on a user-facing error.
CHILD = """
import sys
from pathlib import Path
from quantserve.errors import QuantserveError
from quantserve.formats import read_gguf_info
from quantserve.backends.llamacpp.model import LlamaCppRunner
from quantserve.core.settings import EngineSettings
try:
    info = read_gguf_info(sys.argv[1])
    LlamaCppRunner(Path(sys.argv[1]), EngineSettings(ctx_size=128, max_num_seqs=1, threads=1),
                   n_ctx_train=info.context_length).close()
except QuantserveError as exc:
    print("error:", exc.message, file=sys.stderr)
    sys.exit(2)
"""
KINDS = ("header byte", "vocabulary byte", "repeated token", "length field")


def mutate(data: bytes, kind: str, rng: random.Random, vocab: tuple[int, int], tokens: list[bytes]) -> bytes:
    out = bytearray(data)
    lo, hi = vocab
    if kind == "header byte":
        out[rng.randrange(4, lo)] = rng.randrange(256)
    elif kind == "vocabulary byte":
        out[rng.randrange(lo, hi)] = rng.randrange(256)
    elif kind == "repeated token":
        while True:
            i = rng.randrange(len(tokens) - 1)
            j = rng.randrange(len(tokens))
            if i != j and len(tokens[i]) == len(tokens[j]) and tokens[i] != tokens[j]:
                break
        at = lo + sum(8 + len(t) for t in tokens[:j])  # token j's length field
        out[at + 8 : at + 8 + len(tokens[j])] = tokens[i]
    else:
        at = rng.choice([8, 16, 24, lo + rng.randrange(0, 64) * 8])
        out[at : at + 8] = struct.pack("<Q", rng.choice([0, 1, 2**40, 2**64 - 1]))
    return bytes(out)


def vocabulary_span(data: bytes, tokens: list[str]) -> tuple[int, int, list[bytes]]:
    """Where the vocabulary's strings are in the file: [first length field, end), and the raw tokens."""
    raw = [t.encode() for t in tokens]
    first = struct.pack("<Q", len(raw[0])) + raw[0] + struct.pack("<Q", len(raw[1])) + raw[1]
    lo = data.find(first)
    return lo, lo + sum(8 + len(t) for t in raw), raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutations", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--child-path",
        help="a site dir put first on the child's PYTHONPATH: another tree's quantserve (a baseline)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    # the child runs outside the repository, so that its cwd cannot shadow the quantserve on PYTHONPATH
    env = {**os.environ, "PYTHONPATH": str(Path(args.child_path).resolve())} if args.child_path else None
    src = resolve(args.model, load_registry(find_models_toml(None))).path
    info = read_gguf_info(src)
    whole = src.read_bytes()
    data = whole[: info.data_offset]  # the header and metadata: what is mutated
    lo, hi, tokens = vocabulary_span(data, info.metadata["tokenizer.ggml.tokens"])
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="qs-fuzz-"))
    outcomes: Counter[tuple[str, str]] = Counter()
    deaths: list[str] = []
    for n in range(args.mutations):
        kind = KINDS[n % len(KINDS)]
        mutant = work / "m.gguf"
        mutant.write_bytes(mutate(data, kind, rng, (lo, hi), tokens) + whole[info.data_offset :])
        r = subprocess.run(
            [sys.executable, "-c", CHILD, str(mutant)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=work,
        )
        result = {0: "loaded", 2: "refused"}.get(r.returncode, f"died ({r.returncode})")
        outcomes[(kind, result)] += 1
        if r.returncode not in (0, 2):
            keep = work / f"death-{n}.gguf"
            mutant.rename(keep)
            why = next(
                (ln for ln in r.stderr.splitlines() if "GGML_ASSERT" in ln or "error" in ln.lower()), ""
            )
            deaths.append(f"mutation {n} ({kind}): exit {r.returncode}, kept as {keep}: {why.strip()[:200]}")
        print(f"{n:4d} {kind:16s} {result}", flush=True)
    write(args, src, outcomes, deaths)


def write(args, src: Path, outcomes: Counter, deaths: list[str]) -> None:
    stamp = dt.datetime.now(dt.UTC)
    name = f"gguf-fuzz-{stamp:%Y-%m-%d}" + ("-baseline" if args.child_path else "")
    info = machine_info()
    lines = [
        "# GGUF mutation fuzzing: validated, then loaded by llama.cpp in a child process",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/gguf_fuzz.py --mutations "
        f"{args.mutations} --seed {args.seed} --model {args.model}"
        + (f" --child-path {args.child_path}" if args.child_path else "")
        + "`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(None).items()),
        "",
        f"File: {src.name}. Each mutant is one change to the header or metadata (kinds in turn); the child validates "
        "it with quantserve's GGUF reader and loads it with llama.cpp as `quantserve run` does. `refused`: a "
        "ModelFileError with a message (exit 2); `loaded`: llama.cpp took it; `died`: the process was killed.",
        "",
        "| mutation | loaded | refused | died |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        died = sum(v for (k, res), v in outcomes.items() if k == kind and res.startswith("died"))
        lines.append(
            f"| {kind} | {outcomes[(kind, 'loaded')]} | {outcomes[(kind, 'refused')]} | **{died}** |"
        )
    lines += ["", f"Process deaths: {len(deaths)} of {args.mutations}."] + [f"- {d}" for d in deaths]
    data = {"machine": info, "outcomes": {f"{k}: {r}": v for (k, r), v in outcomes.items()}, "deaths": deaths}
    save_record(args.out, name, lines, data)


if __name__ == "__main__":
    main()
