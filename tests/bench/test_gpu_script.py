"""bench/gpu: the one-call GPU script runs here in its CPU dry run and writes its report, and the staged model's
parts unpack only when whole."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench/gpu"))

import stage  # noqa: E402


@pytest.mark.slow
def test_cpu_smoke_runs_every_step_and_writes_the_report(smollm2_hf, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(ROOT / "bench/gpu/run.sh"), "--cpu-smoke", "--out", str(out), "--model", str(smollm2_hf),
         "--", "--quant", "int4"],
        capture_output=True, text=True, timeout=540, env={**__import__("os").environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    steps = {s["step"]: s for s in results["steps"]}
    assert list(steps) == [
        "env",
        "cuda-tests",
        "gemm",
        "decode",
        "serve",
        "moe-layer",
        "moe-decode",
        "gemma-decode",
        "deltanet",
        "oss-moe",
        "fp8-gemm",
        "tp-nccl",
    ]
    assert all(s["ok"] for s in steps.values())
    tests = steps["cuda-tests"]["result"]
    assert (
        tests["failed"] == 0 and tests["skipped"] > 20
    )  # collected without a GPU and without llama.cpp errors
    assert all(c["ok"] for c in steps["gemm"]["result"]["correctness"])
    assert {r["weights"] for r in steps["decode"]["result"]["rows"]} == {"int4", "float32"}
    serve = steps["serve"]["result"]
    assert serve["paris"] and [b["concurrency"] for b in serve["bench"]] == [1, 8]
    assert all(r["grouped int4"]["rel_err"] < 2e-3 for r in steps["moe-layer"]["result"]["rows"])
    assert {r["weights"] for r in steps["moe-decode"]["result"]["rows"]} == {"int4", "float32"}
    assert {r["weights"] for r in steps["gemma-decode"]["result"]["rows"]} == {"int4", "float32"}
    assert [r["what"] for r in steps["deltanet"]["result"]["rows"]] == ["decode", "decode", "prefill"]
    assert all(r["grouped mxfp4"]["rel_err"] < 1e-2 for r in steps["oss-moe"]["result"]["rows"])
    assert all(
        r[p]["rel_err"] < 1e-2
        for r in steps["fp8-gemm"]["result"]["rows"]
        for p in ("ours fp8", "ours nvfp4")
    )
    report = (out / "report.md").read_text()
    for heading in ("| env | ok", "## CUDA tests", "## Decode", "## Serving smoke test", "(answered)", "## MoE layer",
                    "## MoE decode", "## Gated DeltaNet kernels", "## gpt-oss MoE layer", "## FP8 linears"):  # fmt: skip
        assert heading in report
    for name in ("env", "cuda-tests", "gemm", "decode", "serve"):
        assert (out / "logs" / f"{name}.log").stat().st_size > 0


def test_staged_parts_round_trip_and_refuse_a_missing_or_damaged_part(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (src / "weights.bin").write_bytes(random.Random(0).randbytes(5000))  # incompressible: three parts
    root = tmp_path / "repo"
    root.mkdir()
    parts = stage.make(src, part_mib=0.002, root=root)
    assert len(parts) >= 2 and parts[0].parent.name == ".gpu-early" and parts[1].parent.name == ".gpu"
    got = stage.assemble(tmp_path / "dest", root=root)
    assert (got / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()

    damaged = bytearray(parts[1].read_bytes())
    damaged[-1] ^= 0xFF  # changed, whatever it was (b"x" written over an "x" was no damage)
    parts[1].write_bytes(bytes(damaged))
    with pytest.raises(stage.StageError, match="does not match the manifest"):
        stage.assemble(tmp_path / "dest2", root=root)
    parts[0].unlink()
    with pytest.raises(
        stage.StageError, match="smollm2-gptq.part0 is missing: it travels in its own device call"
    ):
        stage.assemble(tmp_path / "dest3", root=root)


def test_every_gpu_step_command_parses(monkeypatch):
    """The GPU run's commands against each script's own parser: an option one side lacks fails here, not in the
    minutes of a lent GPU (it did once: --marlin)."""
    import argparse
    import importlib.util

    monkeypatch.setattr(
        sys, "path", list(sys.path)
    )  # the scripts put the checkout's root on it: undone after
    sys.path.insert(0, str(ROOT / "bench"))
    import run

    args = argparse.Namespace(cpu_smoke=False, model="/some/model", serve_args=[])
    for step in run.steps(args, Path("/tmp/out")):
        script = Path(step.argv[1])
        if script.name in ("env_info.py",) or step.argv[1:3] == ["-m", "pytest"]:
            continue
        spec = importlib.util.spec_from_file_location(f"_bench_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.parser().parse_args(step.argv[2:])  # SystemExit on an unknown option
