"""What the run ran on: the GPU, driver and library versions, written as JSON to the path given."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import shutil
import subprocess
import sys

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "numpy",
    "fastapi",
    "pydantic",
    "uvicorn",
    "llguidance",
    "openai",
)


def main(path: str) -> None:
    import torch

    info: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": _cpus()}
    info["versions"] = {}
    for name in PACKAGES:
        try:
            info["versions"][name] = md.version(name)
        except md.PackageNotFoundError:
            info["versions"][name] = None
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info["device"] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sm_count": p.multi_processor_count,
            "memory_gib": round(total / 2**30, 1),
            "free_gib": round(free / 2**30, 1),
        }
    else:
        info["device"] = {"name": "cpu"}
    try:
        import llama_cpp  # noqa: F401

        info["llama_cpp"] = "importable"
    except ImportError:
        info["llama_cpp"] = "absent (the torch path must not need it)"
    if shutil.which("nvidia-smi"):
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu"
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True
        )
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    print(json.dumps(info, indent=1))
    with open(path, "w") as f:
        json.dump(info, f, indent=1)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main(sys.argv[1])
