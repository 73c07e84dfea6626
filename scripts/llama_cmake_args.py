"""The CMake arguments llama-cpp-python is built with, for the machine at hand: `make` reads them from here
(`make print-llama-args` shows them). Standard library only: it runs before the virtual environment exists.

    python3 scripts/llama_cmake_args.py            # this machine
    LLAMA_BACKEND=cuda python3 scripts/llama_cmake_args.py

The backend (LLAMA_BACKEND=cpu|metal|cuda|vulkan forces one; auto otherwise):
- **metal** on macOS arm64. llama.cpp enables Metal by default on Apple platforms (ggml/CMakeLists.txt:
  GGML_METAL defaults to ON on APPLE); it is named anyway, so that the log shows what was asked for.
- **cuda** where `nvcc` is on PATH (or CUDACXX names it) and nvidia-smi lists a GPU: -DGGML_CUDA=on, for that
  card's architecture (`native`, which CMake resolves by asking the driver). A toolkit without a GPU (a build
  box, or a CI image like the one these tests run on) stays on the CPU unless LLAMA_BACKEND=cuda asks for CUDA;
  then the build targets Turing through Hopper (75;80;86;89;90), and Blackwell's consumer cards (120) where
  nvcc is 12.8 or newer, since no card can be detected. (A CUDA build compiles for most of an hour on two
  cores, and runs nothing faster without a GPU.)
- **cpu** otherwise.

The x86 flags `-mno-amx-tile -mno-amx-int8 -mno-amx-bf16` go only to x86-64 Linux builds: the CPUs of these
machines advertise AMX but fault on its instructions (SIGILL at tilezero on any batch over one token), and
GGML_NATIVE would otherwise compile them in. Apple's clang rejects them for arm64 targets (they are x86 options),
so a Mac never gets them, nor does any arm64 machine. Every build is native (-DGGML_NATIVE=ON: the CPU code is
tuned to the build machine, as pip builds from source are used on the machine itself), and has llama.cpp's RPC
backend (-DGGML_RPC=ON), for `quantserve rpc-worker` and `run --rpc`.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CUDA_ARCHS = "75;80;86;89;90"  # Turing, Ampere (A100, RTX 30), Ada (RTX 40), Hopper
BACKENDS = ("cpu", "metal", "cuda", "vulkan")


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) from `nvcc --version` ("Cuda compilation tools, release 12.8, V12.8.61")."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def cmake_args(
    system: str,
    machine: str,
    backend: str = "auto",
    nvcc: str | None = None,
    nvcc_release: tuple[int, int] | None = None,
    gpu_present: bool = False,
) -> list[str]:
    """The arguments for `system` (platform.system(): Linux, Darwin, Windows) and `machine` (x86_64, AMD64,
    arm64, aarch64). `nvcc`: its path, if found; `gpu_present`: nvidia-smi lists a GPU.

    Raises:
        ValueError: an unknown backend, or cuda without nvcc, or metal off Apple.
    """
    x86 = machine.lower() in ("x86_64", "amd64")
    if backend == "auto":
        if system == "Darwin" and not x86:
            backend = "metal"
        elif nvcc and gpu_present:
            backend = "cuda"
        else:
            backend = "cpu"
    if backend not in BACKENDS:
        raise ValueError(
            f"LLAMA_BACKEND={backend!r}: choose one of {', '.join(BACKENDS)} (or leave it unset)"
        )
    # RPC: `quantserve rpc-worker` serves this machine's devices to others, `run --rpc` uses theirs (a small backend)
    args = ["-DGGML_NATIVE=ON", "-DGGML_RPC=ON"]
    if system == "Linux" and x86:
        args += [f"-DCMAKE_C_FLAGS='{NO_AMX}'", f"-DCMAKE_CXX_FLAGS='{NO_AMX}'"]
    if backend == "metal":
        if system != "Darwin":
            raise ValueError("LLAMA_BACKEND=metal needs macOS (Apple's Metal)")
        args.append("-DGGML_METAL=on")
    elif backend == "cuda":
        if not nvcc:
            raise ValueError("LLAMA_BACKEND=cuda needs nvcc (the CUDA toolkit) on PATH, or CUDACXX set to it")
        if gpu_present:
            archs = "native"
        else:
            archs = CUDA_ARCHS + (";120" if nvcc_release and nvcc_release >= (12, 8) else "")
        args += ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES='{archs}'"]
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=on")
    elif system == "Darwin":
        args.append("-DGGML_METAL=off")
    return args


def main() -> int:
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    try:
        args = cmake_args(
            os.environ.get("UNAME_S") or platform.system(),
            os.environ.get("UNAME_M") or platform.machine(),
            os.environ.get("LLAMA_BACKEND") or "auto",
            nvcc,
            nvcc_version(nvcc) if nvcc else None,
            has_nvidia_gpu() if nvcc else False,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(" ".join(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
