"""The CUDA half on a GPU in one run: the CUDA tests, the W4A16 GEMM benchmark, the decode benchmark and a serving
smoke test, each a child process with its own time limit, so that a failure or a hang in one step never stops the
others. Writes `results.json`, `report.md` and `logs/<step>.log` into --out.

    bench/gpu/run.sh --out DIR                 # on a CUDA machine (run.sh installs .whl/ first)
    bench/gpu/run.sh --cpu-smoke --out DIR     # anywhere: tiny shapes, the CPU and Triton's interpreter

Each step is a command line; its own script writes a JSON result that the report summarises next to the targets
(issue 30: W4A16 >= 3x fp16 at M <= 16 on the large 8B shapes, >= 1.0x tinygemm at M = 1, >= 0.9x fp16 at
M >= 128; decode of the 8B shape at 4 bits >= 250 tok/s at batch 1 and >= 2,400 at batch 16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import render  # noqa: E402

# The tests that need a GPU (marked `cuda`), in files that import nothing of the llama.cpp backend.
CUDA_TESTS = [
    "tests/backends/torch/test_cuda.py",
    "tests/kernels/test_w4a16_kernels.py",
    "tests/kernels/test_marlin_layout.py",
    "tests/backends/torch/test_torch_sampler.py",
    "tests/kernels/test_paged_attention.py",
    "tests/backends/torch/test_torch_graphs.py",
    "tests/kernels/test_fused_kernels.py",
    "tests/kernels/test_moe_kernel.py",
    "tests/backends/torch/test_cuda_moe.py",
    "tests/backends/torch/test_cuda_families.py",
    "tests/kernels/test_fp8_kernel.py",
]


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout: float
    result: str | None = None  # the JSON file the step writes, relative to --out
    env: dict[str, str] = field(default_factory=dict)


def steps(args: argparse.Namespace, out: Path) -> list[Step]:
    py = sys.executable
    smoke = args.cpu_smoke
    interp = {"TRITON_INTERPRET": "1"} if smoke else {}
    junit = str(out / "cuda-tests.xml")
    # --import-mode=append: the tree's root goes last on sys.path, after run.sh's installed layout
    tests = [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--import-mode=append", "-m", "cuda",
             "--timeout", "90", f"--junitxml={junit}"]  # fmt: skip
    serve = [py, str(ROOT / "bench/gpu/serve_smoke.py"), "--out", str(out / "serve.json")]
    serve += ["--max-tokens", "8", "--requests", "4"] if smoke else []  # CPU: a few tokens prove the path
    if args.model:
        serve += ["--model", args.model]
    # the bench's 8 clients decode together on the GPU (the default, 4, is a CPU's)
    run_args = args.serve_args or ([] if smoke else ["--max-num-seqs", "8"])
    serve += ["--", *run_args] if run_args else []
    gemm = [py, str(ROOT / "bench/w4a16_gemm.py")]
    decode = [py, str(ROOT / "bench/torch_decode.py")]
    moe = [py, str(ROOT / "bench/moe_gemm.py")]
    moe_decode = decode + ["--shape", "qwen3-30b-a3b"]
    gemma_decode = decode + ["--shape", "gemma3-12b"]
    deltanet = [py, str(ROOT / "bench/deltanet_kernels.py"), "--out", str(out / "deltanet.json")]
    oss_moe = [py, str(ROOT / "bench/mxfp4_moe.py"), "--out", str(out / "oss-moe.json")]
    fp8_gemm = [py, str(ROOT / "bench/fp8_gemm.py"), "--out", str(out / "fp8-gemm.json")]
    tp = Step("tp-nccl", [py, str(ROOT / "bench/gpu/tp_nccl.py"), "--out", str(out / "tp-nccl.json")], 90,
              "tp-nccl.json")  # fmt: skip
    env = Step("env", [py, str(ROOT / "bench/gpu/env_info.py"), str(out / "env.json")], 30, "env.json")
    if smoke:
        # On the CPU every `cuda` test skips: this proves the files collect without a GPU or llama.cpp.
        return [
            env,
            Step("cuda-tests", tests + CUDA_TESTS, 120, None),
            Step("gemm", gemm + ["--cpu-smoke", "--out", str(out / "gemm.json")], 240, "gemm.json", interp),
            Step(
                "decode",
                decode
                + ["--cpu-smoke", "--batches", "1,4", "--steps", "4", "--warmup", "1", "--out"]
                + [str(out / "decode.json")],
                240,
                "decode.json",
            ),  # fmt: skip
            Step("serve", serve, 300, "serve.json"),
            Step(
                "moe-layer",
                moe + ["--cpu-smoke", "--out", str(out / "moe-layer.json")],
                120,
                "moe-layer.json",
            ),
            Step(
                "moe-decode",
                moe_decode
                + ["--cpu-smoke", "--batches", "1,4", "--steps", "3", "--warmup", "1", "--out"]
                + [str(out / "moe-decode.json")],
                240,
                "moe-decode.json",
            ),  # fmt: skip
            Step(
                "gemma-decode",
                gemma_decode
                + ["--cpu-smoke", "--batches", "1,4", "--ctx", "40", "--steps", "3", "--warmup", "1", "--out"]
                + [str(out / "gemma-decode.json")],
                240,
                "gemma-decode.json",
            ),  # fmt: skip
            Step("deltanet", deltanet + ["--cpu-smoke"], 120, "deltanet.json"),
            Step("oss-moe", oss_moe + ["--cpu-smoke"], 120, "oss-moe.json"),
            Step("fp8-gemm", fp8_gemm + ["--cpu-smoke"], 60, "fp8-gemm.json"),
            tp,
        ]
    # The numbers first: a step that overruns only cuts what comes after it.
    return [
        env,
        Step(
            "gemm",
            gemm + ["--tinygemm", "--both-dtypes", "--marlin", "--out", str(out / "gemm.json")],
            100,
            "gemm.json",
        ),
        Step(
            "decode", decode + ["--batches", "1,16,64", "--out", str(out / "decode.json")], 100, "decode.json"
        ),
        Step("cuda-tests", tests + CUDA_TESTS, 240, None),
        # Qwen3.5's Gated DeltaNet: the Triton kernels against the PyTorch forms, decode and prefill
        Step("deltanet", deltanet, 60, "deltanet.json"),
        # a mixture of experts: one Qwen3-30B-A3B layer against its peers, then decode of 12 of its 48 layers
        Step("moe-layer", moe + ["--out", str(out / "moe-layer.json")], 90, "moe-layer.json"),
        # gpt-oss: one gpt-oss-20b MoE layer, its MXFP4 experts grouped against the loop and the bf16 peers
        Step("oss-moe", oss_moe, 90, "oss-moe.json"),
        # FP8 checkpoints: our W8A16 kernel at Llama-3-8B's shapes against cuBLAS bf16 and torch._scaled_mm
        Step("fp8-gemm", fp8_gemm, 60, "fp8-gemm.json"),
        Step(
            "moe-decode",
            moe_decode + ["--layers", "12", "--batches", "1,16,64", "--out", str(out / "moe-decode.json")],
            120,
            "moe-decode.json",
        ),
        # Gemma 3: its windowed layers in the paged kernel and CUDA graphs, at a context past the window (12 of
        # its 48 layers)
        Step(
            "gemma-decode",
            gemma_decode
            + [
                "--layers",
                "12",
                "--ctx",
                "2048",
                "--batches",
                "1,16,64",
                "--out",
                str(out / "gemma-decode.json"),
            ],
            120,
            "gemma-decode.json",
        ),
        Step("serve", serve, 60, "serve.json"),
        # tensor parallel's NCCL path at TP=1 (one GPU cannot run TP=2) against the plain runner
        tp,
        # last, with what time is left: launch configs around the heuristic on the large shapes
        Step(
            "gemm-sweep",
            gemm
            + ["--shapes", "gate_up,down", "--m", "1,16,64", "--sweep", "--sweep-budget", "60", "--out"]
            + [str(out / "gemm-sweep.json")],
            100,
            "gemm-sweep.json",
        ),
    ]


def run_step(step: Step, out: Path) -> dict:
    """Run one step as its own process group, killed at its time limit; what it printed goes to its log."""
    log_path = out / "logs" / f"{step.name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    t0 = time.monotonic()
    with log_path.open("w") as log:
        log.write("$ " + " ".join(step.argv) + "\n")
        log.flush()
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(step.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc, timed_out = proc.wait(), True
    row: dict = {
        "step": step.name,
        "rc": rc,
        "timed_out": timed_out,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    row["ok"] = rc == 0 and not timed_out
    if step.result and (out / step.result).is_file():
        try:
            row["result"] = json.loads((out / step.result).read_text())
        except json.JSONDecodeError as exc:
            row["ok"], row["error"] = False, f"{step.result} is not JSON: {exc}"
    elif step.result:
        row["ok"] = False
        row["error"] = f"{step.result} was not written"
    if step.name == "cuda-tests":
        row["result"] = junit_counts(out / "cuda-tests.xml", log_path)
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    row["log_tail"] = tail
    status = "ok" if row["ok"] else ("TIMED OUT" if timed_out else f"FAILED rc={rc}")
    print(f"[{step.name}] {status} in {row['wall_s']} s", flush=True)
    if not row["ok"]:
        print("\n".join("    " + line for line in tail), flush=True)
    return row


def stage_model(args: argparse.Namespace, out: Path, results: dict) -> None:
    """Unpack the carried SmolLM2 GPTQ (bench/gpu/stage.py) once, for the CUDA tests (QUANTSERVE_GPU_MODEL) and
    the serving smoke test; without it those parts skip or say why."""
    from stage import StageError, assemble

    try:
        path = assemble(Path(tempfile.gettempdir()) / "quantserve-gpu-model")
    except StageError as exc:
        results["staged_model"] = f"none: {exc}"
        print(f"staged model: none ({exc})", flush=True)
        return
    os.environ["QUANTSERVE_GPU_MODEL"] = str(path)
    results["staged_model"] = str(path)
    if args.model is None:
        args.model = str(path)


def junit_counts(path: Path, log: Path | None = None) -> dict:
    """Passed / failed / skipped counts and the failing test names from pytest's JUnit XML, or, when pytest was
    killed before writing it, from the verbose log's per-test lines."""
    if not path.is_file():
        if log is None or not log.is_file():
            return {"error": "no junit xml"}
        counts = {
            "passed": 0,
            "failed": 0,
            "skipped": 0,
            "failures": [],
            "note": "pytest was cut off: from the log",
        }
        for line in log.read_text(errors="replace").splitlines():
            name, _, outcome = line.partition(" ")
            if "::" in name and outcome.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED")):
                key = {"PASSED": "passed", "SKIPPED": "skipped"}.get(outcome.split()[0], "failed")
                counts[key] += 1
                if key == "failed":
                    counts["failures"].append(name)
        return counts
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        kids = {child.tag for child in case}
        if kids & {"failure", "error"}:
            counts["failed"] += 1
            counts["failures"].append(f"{case.get('classname')}::{case.get('name')}")
        elif "skipped" in kids:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for results.json, report.md and logs/")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the script itself"
    )
    ap.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all the steps (default 480)")
    ap.add_argument("--model", default=None, help="the serving smoke test's model (default: the staged one)")
    ap.add_argument(
        "serve_args", nargs="*", help="after --: extra `quantserve run` options for the smoke test"
    )
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = {
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "steps": [],
    }
    stage_model(args, out, results)
    chosen = steps(args, out)
    if args.only:
        names = set(args.only.split(","))
        if unknown := names - {s.name for s in chosen}:
            ap.error(f"unknown steps {sorted(unknown)}; known: {', '.join(s.name for s in chosen)}")
        chosen = [s for s in chosen if s.name in names]
    for step in chosen:
        left = args.budget - (time.monotonic() - t0)
        if left < 10:
            results["steps"].append({"step": step.name, "ok": False, "rc": None, "timed_out": True, "wall_s": 0,
                                     "error": f"not run: the run's --budget of {args.budget:.0f} s was spent"})  # fmt: skip
            continue
        step.timeout = min(step.timeout, left)
        results["steps"].append(run_step(step, out))
        results["wall_s"] = round(time.monotonic() - t0, 1)
        # written after every step: a run killed from outside still leaves what it measured
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "report.md").write_text(render(results))
    print((out / "report.md").read_text())
    return 0 if all(s["ok"] for s in results["steps"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
