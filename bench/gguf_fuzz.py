"""A seeded mutation fuzzer over a GGUF's header and metadata: each mutant goes through quantserve's validator in
this process and, if accepted, through the llama.cpp probe (quantserve.backends.llamacpp.probe) in a child, as the
server would load it. A child killed by a signal is a validator hole that the probe contained. With --via load,
each mutant is loaded by `quantserve.load()` in a child instead, the way a library user loads a file: that child
must never die by a signal, since the plan probes every GGUF before the load.

    nice -n 19 .venv/bin/python bench/gguf_fuzz.py [--n 200] [--seed 7] [--cost] [--via probe|load] \
        [--out bench/results/gguf-fuzz-2026-11-24.md]

Writes the record to --out (markdown) and the raw outcomes beside it (.json). --cost adds what a probe costs:
its wall time against an in-process load of the same file, median of 5 each (--n 0 --cost measures only that).

Every mutation changes bytes in place (the header keeps its size, the tensor data stays where it is), one per
mutant, kinds in turn: a random byte; a size field (tensor or KV count, a key's, string's or tensor name's length,
an array's length, n_dims) set to an edge value; a KV's value type tag; an array's element type; an integer or
float hyper-parameter set to an edge value (0, 1, all ones, negative as unsigned, NaN, ...); a token string made
equal to another; a special token id out of range; a token type out of range; a merge without its space; a
tensor's ggml type changed where the table stays valid (F32 to I32, the last tensor to a smaller type).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import shlex
import signal
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: import the quantserve beside it
sys.path.insert(0, str(ROOT / "bench"))

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from serving import machine_info, versions  # noqa: E402

from quantserve.backends.llamacpp.probe import ProbeCrashError, probe_gguf  # noqa: E402
from quantserve.errors import ModelFileError  # noqa: E402
from quantserve.formats import read_gguf_info  # noqa: E402
from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402

KINDS = (
    "random byte",
    "size field",
    "value type",
    "array element type",
    "hparam edge",
    "repeated token",
    "token id",
    "token type",
    "merge",
    "tensor type",
)
OUTCOMES = ("validator refused", "llama.cpp refused", "loaded and decoded", "killed by signal", "other death")
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
TYPE_NAMES = {int(t): t.name for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


@dataclass
class Layout:
    """Where the header's fields are, as offsets into the file, grouped by what a mutation can aim at:
    length and count fields (offset, width, what), KV value type tags and array element types (offset, key),
    scalar values (offset, GGUF type, key), string arrays' elements (offset, length) and integer arrays' elements
    (offset) by key."""

    sizes: list[tuple[int, int, str]] = field(default_factory=list)
    vtypes: list[tuple[int, str]] = field(default_factory=list)
    etypes: list[tuple[int, str]] = field(default_factory=list)
    scalars: list[tuple[int, int, str]] = field(default_factory=list)
    strings: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    ints: dict[str, list[int]] = field(default_factory=dict)
    tensors: list[tuple[int, str, tuple[int, ...], int]] = field(
        default_factory=list
    )  # type at, name, shape, type


def layout(data: bytes) -> Layout:
    """Map a valid GGUF header (read_gguf_info accepted it)."""
    out = Layout(sizes=[(8, 8, "tensor_count"), (16, 8, "kv_count")])
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(at: int) -> int:
        return at + 8 + struct.unpack_from("<Q", data, at)[0]

    for _ in range(n_kv):
        key = data[pos + 8 : string(pos)].decode()
        out.sizes.append((pos, 8, f"length of key {key}"))
        pos = string(pos)
        vtype = struct.unpack_from("<I", data, pos)[0]
        out.vtypes.append((pos, key))
        pos += 4
        if vtype in _SCALAR:
            out.scalars.append((pos, vtype, key))
            pos += struct.calcsize(_SCALAR[vtype])
        elif vtype == STRING:
            out.sizes.append((pos, 8, f"length of {key}'s value"))
            pos = string(pos)
        else:  # an array; the header's arrays are flat
            etype, count = struct.unpack_from("<IQ", data, pos)
            out.etypes.append((pos, key))
            out.sizes.append((pos + 4, 8, f"length of array {key}"))
            pos += 12
            if etype == STRING:
                elems = out.strings.setdefault(key, [])
                for _ in range(count):
                    elems.append((pos, struct.unpack_from("<Q", data, pos)[0]))
                    pos = string(pos)
            else:
                width = struct.calcsize(_SCALAR[etype])
                if etype not in (6, 7, 12):
                    out.ints[key] = list(range(pos, pos + count * width, width))
                pos += count * width
    for _ in range(n_tensors):
        out.sizes.append((pos, 8, "length of a tensor name"))
        name = data[pos + 8 : string(pos)].decode()
        pos = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        out.sizes.append((pos, 4, "a tensor's n_dims"))
        shape = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        pos += 4 + 8 * n_dims
        out.tensors.append((pos, name, shape, struct.unpack_from("<I", data, pos)[0]))
        pos += 4 + 8
    return out


def edge_ints(width: int, old: int) -> list[int]:
    top = 1 << (8 * width)
    return [0, 1, top - 1, top >> 1, (top >> 1) - 1, (old - 1) % top, (old + 1) % top, min(old * 2, top - 1)]


EDGE_FLOATS = [0.0, -1.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e30, 1e-30]


def hparam_edges(data: bytes, lay: Layout) -> list[tuple[int, bytes, str]]:
    """Every number the model's hyper-parameters hold (not bools, nor general.*, which llama.cpp does not
    compute with) set to each edge value of its type, as mutations."""
    out = []
    for at, vtype, key in lay.scalars:
        if vtype == 7 or key.startswith("general."):
            continue
        fmt = "<" + _SCALAR[vtype]
        (old,) = struct.unpack_from(fmt, data, at)
        if vtype in (6, 12):
            out += [(at, struct.pack(fmt, new), f"{key}: {old:g} -> {new:g}") for new in EDGE_FLOATS]
        else:
            width = struct.calcsize(fmt)
            out += [
                (at, new.to_bytes(width, "little"), f"{key}: {old} -> {new} (as unsigned)")
                for new in dict.fromkeys(edge_ints(width, old % (1 << 8 * width)))
            ]
    return out


def retypes(lay: Layout) -> list[tuple[int, str, int]]:
    """(type offset, tensor, new ggml type) that keep the tensor table valid: a type of the same bytes per element
    (F32 and I32, F16 and BF16, ...), or for the file's last tensor any type whose data fits in its bytes."""
    out = []

    def n_bytes(shape: tuple[int, ...], t: int) -> int | None:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        return None if shape[0] % block else math.prod(shape) // block * size

    for k, (at, name, shape, old) in enumerate(lay.tensors):
        for t in TYPE_NAMES:
            have, new = n_bytes(shape, old), n_bytes(shape, t)
            last = k == len(lay.tensors) - 1
            if t != old and new is not None and (new == have or last and new <= have):
                out.append((at, name, t))
    return out


def mutate(
    data: bytes, lay: Layout, kind: str, rng: random.Random, edges: list[tuple[int, bytes, str]]
) -> tuple[int, bytes, str]:
    """One mutation: (offset, new bytes, what it did). `edges`: the hparam edge cases not yet used."""
    if kind == "random byte":
        at = rng.randrange(4, len(data))
        return at, bytes([rng.randrange(256)]), f"byte {at} set"
    if kind == "size field":
        at, width, what = rng.choice(lay.sizes)
        old = int.from_bytes(data[at : at + width], "little")
        new = rng.choice(edge_ints(width, old))
        return at, new.to_bytes(width, "little"), f"{what}: {old} -> {new}"
    if kind in ("value type", "array element type"):
        at, key = rng.choice(lay.vtypes if kind == "value type" else lay.etypes)
        old = struct.unpack_from("<I", data, at)[0]
        new = rng.choice([t for t in range(14) if t != old] + [0xFFFFFFFF])
        return at, struct.pack("<I", new), f"{kind} of {key}: {old} -> {new}"
    if kind == "hparam edge":  # every (key, edge value) pair once, in a seeded order, before any twice
        if not edges:
            edges.extend(hparam_edges(data, lay))
            rng.shuffle(edges)
        return edges.pop()
    tokens = lay.strings["tokenizer.ggml.tokens"]
    if kind == "repeated token":
        while True:
            i = rng.randrange(len(tokens))
            (ai, ni), (at, nj) = tokens[i], rng.choice(tokens)
            if ni == nj and data[ai + 8 : ai + 8 + ni] != data[at + 8 : at + 8 + nj]:
                break
        return at + 8, data[ai + 8 : ai + 8 + ni], f"token at offset {at} made a copy of token {i}"
    if kind == "token id":
        ids = [s for s in lay.scalars if s[2].startswith("tokenizer.ggml.") and s[2].endswith("_token_id")]
        at, vtype, key = rng.choice(ids)
        width = struct.calcsize(_SCALAR[vtype])
        new = rng.choice([len(tokens), len(tokens) + 1, 2**31 - 1, 2**31, 2**32 - 1]) % (1 << 8 * width)
        return at, new.to_bytes(width, "little"), f"{key} -> {new} (vocabulary of {len(tokens)})"
    if kind == "token type":
        i = rng.randrange(len(lay.ints["tokenizer.ggml.token_type"]))
        new = rng.choice([0, 2, 3, 4, 5, 6, 7, 99, -1, 2**31 - 1])
        at = lay.ints["tokenizer.ggml.token_type"][i]
        return at, struct.pack("<i", new), f"token_type[{i}] -> {new}"
    if kind == "tensor type":
        at, name, new = rng.choice(retypes(lay))
        old = struct.unpack_from("<I", data, at)[0]
        return at, struct.pack("<I", new), f"{name}: type {TYPE_NAMES[old]} -> {TYPE_NAMES[new]}"
    merges = lay.strings["tokenizer.ggml.merges"]
    i = rng.randrange(len(merges))
    at, n = merges[i]
    old = data[at + 8 : at + 8 + n]
    new = rng.choice([old.replace(b" ", b"x"), b" " + old[1:], old[:-1] + b" "])
    return at + 8, new, f"merge {i}: {old!r} -> {new!r}"


def fuzz(src: Path, n: int, seed: int, via: str = "probe") -> dict:
    info = read_gguf_info(src)
    header = src.read_bytes()[: info.data_offset]
    lay = layout(header)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="qs-fuzz-")) / "m.gguf"
    work.write_bytes(src.read_bytes())
    counts: Counter[tuple[str, str]] = Counter()
    deaths: list[dict] = []
    edges: list[tuple[int, bytes, str]] = []
    bugs: list[dict] = []
    with work.open("r+b") as f:
        for i in range(n):
            kind = KINDS[i % len(KINDS)]
            at, new, what = mutate(header, lay, kind, rng, edges)
            f.seek(at)
            f.write(new)
            f.flush()
            try:
                outcome, line = classify(work) if via == "probe" else classify_load(work)
            finally:
                f.seek(at)
                f.write(header[at : at + len(new)])
                f.flush()
            if outcome == "validator bug":
                bugs.append({"n": i, "kind": kind, "mutation": what, "exception": line})
            counts[(kind, outcome)] += 1
            if outcome in ("killed by signal", "other death"):
                deaths.append({"n": i, "kind": kind, "mutation": what, "why": line})
            print(f"{i:4d} {kind:18s} {outcome:18s} {what[:70]}  {line[:90]}", flush=True)
    work.unlink()
    work.parent.rmdir()
    return {"counts": counts, "deaths": deaths, "bugs": bugs}


# --via load: a new user's path, `quantserve.load()` in a child process, which plans the model (the validator) and
# probes it in a grandchild before loading it in the child. Exit 2 on a refusal, with its message.
LOAD_CHILD = """
import sys
import quantserve
from quantserve.errors import QuantserveError
try:
    quantserve.load(sys.argv[1], ctx_size=64, n_batch=64, max_num_seqs=1, threads=1).close()
except QuantserveError as exc:
    print("error:", exc.message, file=sys.stderr)
    sys.exit(2)
"""


def classify_load(path: Path) -> tuple[str, str]:
    import subprocess

    from quantserve.backends.llamacpp.probe import telling_line

    try:
        read_gguf_info(path)
        refused = "llama.cpp refused"
    except ModelFileError:
        refused = "validator refused"
    except Exception as exc:  # noqa: BLE001
        return "validator bug", f"{type(exc).__name__}: {exc}"
    try:
        r = subprocess.run(
            [sys.executable, "-c", LOAD_CHILD, str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return "other death", "timed out after 300 s"
    last = telling_line(r.stderr)
    if r.returncode == 0:
        return "loaded and decoded", ""
    if r.returncode == 2:
        return refused, last
    if r.returncode < 0:
        return "killed by signal", f"{signal.Signals(-r.returncode).name}: {last}"
    return "other death", f"exit {r.returncode}: {last}"


def classify(path: Path) -> tuple[str, str]:
    try:
        read_gguf_info(path)
    except ModelFileError as exc:
        return "validator refused", exc.message
    except Exception as exc:  # noqa: BLE001 — any other exception is a bug in the validator: count it, go on
        return "validator bug", f"{type(exc).__name__}: {exc}"
    try:
        probe_gguf(path, timeout=120)
    except ProbeCrashError as exc:
        if exc.returncode is not None and exc.returncode < 0:
            return "killed by signal", f"{signal.Signals(-exc.returncode).name}: {exc.detail}"
        return "other death", exc.message
    except ModelFileError as exc:
        return "llama.cpp refused", exc.message
    return "loaded and decoded", ""


def cost(src: Path, repeats: int = 5) -> dict:
    """Seconds for a probe (a child: interpreter, imports, validation, load, one token) and for in-process loads."""
    from quantserve.backends.llamacpp.model import LlamaCppRunner
    from quantserve.backends.llamacpp.probe import PROBE_CTX
    from quantserve.core.settings import EngineSettings

    probe_settings = EngineSettings(ctx_size=PROBE_CTX, n_batch=PROBE_CTX, max_num_seqs=1, threads=1)

    def load(settings: EngineSettings) -> float:
        t0 = time.perf_counter()
        LlamaCppRunner(src, settings).close()
        return time.perf_counter() - t0

    probe_gguf(src)  # warm the page cache and the interpreter's imports on disk
    rows = {
        "probe (child process)": [probe_gguf(src) for _ in range(repeats)],
        "in-process load, server defaults": [load(EngineSettings()) for _ in range(repeats)],
        "in-process load, the probe's settings": [load(probe_settings) for _ in range(repeats)],
    }
    return {name: {"median_s": statistics.median(v), "runs_s": v} for name, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--n", type=int, default=200, help="mutants (0: none, with --cost to measure only the cost)"
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default="smollm2", help="a models.toml name or a GGUF path")
    ap.add_argument("--cost", action="store_true", help="also measure the probe's cost (median of 5)")
    ap.add_argument(
        "--via",
        choices=("probe", "load"),
        default="probe",
        help="probe: the validator here, then probe_gguf; load: quantserve.load() in a child for every mutant",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/gguf-fuzz-2026-11-24.md")
    args = ap.parse_args()
    src = resolve(args.model, load_registry(find_models_toml(None))).path
    started = dt.datetime.now(dt.UTC)
    result = fuzz(src, args.n, args.seed, args.via) if args.n else None
    costs = cost(src) if args.cost else None
    write(args, src, started, result, costs)


def write(args, src: Path, started: dt.datetime, result: dict | None, costs: dict | None) -> None:
    info = machine_info()
    command = shlex.join([".venv/bin/python", "bench/gguf_fuzz.py", *sys.argv[1:]])
    lines = [
        "# GGUF mutation fuzzing: quantserve's validator, then the llama.cpp probe in a child process"
        + (" (through quantserve.load())" if args.via == "load" else ""),
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC. Command: `{command}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB, {info['platform']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(None).items()),
        "",
    ]
    data: dict = {"machine": info, "seed": args.seed, "n": args.n, "file": src.name}
    if result is not None:
        counts, deaths, bugs = result["counts"], result["deaths"], result["bugs"]
        lines += [
            f"File: {src.name}; seed {args.seed}; {args.n} mutants, each one in-place change to the header or "
            "metadata (kinds in turn, see the script's docstring). "
            + (
                "Each goes through `read_gguf_info` in the "
                "fuzzing process, and if accepted through `probe_gguf`, which loads it with llama.cpp and evaluates "
                "one token in a child process. `llama.cpp refused`: the child exited 2 with a message; `killed by "
                "signal`: llama.cpp aborted the child, a hole in the validator that the probe contained."
                if args.via == "probe"
                else "Each is loaded by `quantserve.load(path, ctx_size=64)` in a child process, as a library user "
                "would load it: the plan validates the header, the probe loads it in a grandchild, then the child "
                "loads it itself. `validator refused` / `llama.cpp refused`: the child exited 2 with a message "
                "(told apart by whether `read_gguf_info` accepts the file); `killed by signal`: the child itself "
                "died, which the plan's probe must prevent."
            ),
            "",
            f"The fuzzing process ran all {args.n} to the end.",
            "",
            "| mutation | " + " | ".join(OUTCOMES) + " | validator bug |",
            "|---" * (len(OUTCOMES) + 2) + "|",
        ]
        for kind in (*KINDS, "all"):
            row = [
                sum(v for (k, o), v in counts.items() if o == outcome and kind in (k, "all"))
                for outcome in (*OUTCOMES, "validator bug")
            ]
            lines.append(f"| {kind} | " + " | ".join(str(c) for c in row) + " |")
        lines += ["", f"Children killed by a signal or dying otherwise: {len(deaths)} of {args.n}."]
        causes = Counter(d["why"] for d in deaths)
        if causes:
            lines += ["", "| the child's last words | deaths | first mutant |", "|---|---|---|"]
            for why, count in causes.most_common():
                first = next(d for d in deaths if d["why"] == why)
                lines.append(f"| `{why}` | {count} | {first['n']}: {first['mutation']} |")
            lines += ["", "Each death:", ""]
        lines += [f"- mutant {d['n']} ({d['kind']}): {d['mutation']} — {d['why']}" for d in deaths]
        lines += ["", f"Validator bugs (an exception other than ModelFileError): {len(bugs)}."]
        lines += [f"- mutant {b['n']} ({b['kind']}): {b['mutation']} — {b['exception']}" for b in bugs]
        lines.append("")
        data |= {"counts": {f"{k}: {o}": v for (k, o), v in counts.items()}, "deaths": deaths, "bugs": bugs}
    if costs is not None:
        lines += [
            f"## What a probe costs ({src.name}, median of 5, page cache warm)",
            "",
            "| | median s | runs s |",
            "|---|---|---|",
        ]
        lines += [
            f"| {name} | {c['median_s']:.3f} | " + ", ".join(f"{s:.3f}" for s in c["runs_s"]) + " |"
            for name, c in costs.items()
        ]
        lines += [
            "",
            "The probe's time is the parent's wall time around the child: a Python interpreter starting, "
            "quantserve and llama-cpp-python imported, the header validated, the model loaded with a 64-cell "
            "context, a short text tokenized and one token evaluated. It is paid once per file version "
            "(ProbeCache); a re-load after an unload costs nothing.",
            "",
        ]
        data["cost"] = costs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
