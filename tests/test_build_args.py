"""The llama.cpp build arguments `make` chooses (scripts/llama_cmake_args.py through `make print-llama-args`), on
faked platforms with a faked nvcc and nvidia-smi on PATH: what each kind of machine builds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_AMX = "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def fake_tools(tmp: Path, nvcc_release: str | None, gpu: bool) -> Path:
    """A folder holding a fake nvcc (answering --version with this release) and nvidia-smi (listing a GPU)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvcc_release:
        nvcc = bin_dir / "nvcc"
        nvcc.write_text(
            f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.1'\n"
        )
        nvcc.chmod(0o755)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-0)'\n")
        smi.chmod(0o755)
    return bin_dir


def llama_args(tmp: Path, system: str, machine: str, nvcc: str | None = None, gpu: bool = False, **make_vars):
    """`make -s print-llama-args` on a PATH with only the fake tools and the system's own folders."""
    path = f"{fake_tools(tmp, nvcc, gpu)}:/usr/bin:/bin"
    cmd = [
        "make",
        "-s",
        "print-llama-args",
        f"UNAME_S={system}",
        f"UNAME_M={machine}",
        f"PYTHON={sys.executable}",
    ]
    cmd += [f"{k}={v}" for k, v in make_vars.items()]
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "LLAMA_BACKEND", "LLAMA_CMAKE_ARGS")}
    return subprocess.run(
        cmd, cwd=ROOT, env={**env, "PATH": path}, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "system,machine,nvcc,gpu,want",
    [
        ("Linux", "x86_64", None, False, f"-DGGML_NATIVE=ON -DGGML_RPC=ON {NO_AMX}"),  # these machines: as before
        ("Linux", "x86_64", "13.0", False, f"-DGGML_NATIVE=ON -DGGML_RPC=ON {NO_AMX}"),  # a toolkit but no card (CI)
        ("Linux", "x86_64", "12.4", True,
         f"-DGGML_NATIVE=ON -DGGML_RPC=ON {NO_AMX} -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES='native'"),
        ("Darwin", "arm64", None, False, "-DGGML_NATIVE=ON -DGGML_RPC=ON -DGGML_METAL=on"),  # a Mac laptop: no x86 flags
        ("Linux", "aarch64", None, False, "-DGGML_NATIVE=ON -DGGML_RPC=ON"),
        ("Linux", "aarch64", "12.6", True, "-DGGML_NATIVE=ON -DGGML_RPC=ON -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES='native'"),
        ("Darwin", "x86_64", None, False, "-DGGML_NATIVE=ON -DGGML_RPC=ON -DGGML_METAL=off"),  # an Intel Mac: CPU
    ],
)  # fmt: skip
def test_each_platform_gets_its_backend(tmp_path, system, machine, nvcc, gpu, want):
    out = llama_args(tmp_path, system, machine, nvcc, gpu)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_forcing_a_backend(tmp_path):
    cuda = llama_args(
        tmp_path, "Linux", "x86_64", "12.8", LLAMA_BACKEND="cuda"
    )  # no card: a list, with Blackwell
    assert (
        cuda.stdout.strip()
        == f"-DGGML_NATIVE=ON -DGGML_RPC=ON {NO_AMX} -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES='75;80;86;89;90;120'"
    )
    (tmp_path / "old").mkdir()
    old = llama_args(tmp_path / "old", "Linux", "x86_64", "12.4", LLAMA_BACKEND="cuda")
    assert old.stdout.strip().endswith("-DCMAKE_CUDA_ARCHITECTURES='75;80;86;89;90'")
    assert (
        llama_args(tmp_path, "Linux", "x86_64", LLAMA_BACKEND="vulkan")
        .stdout.strip()
        .endswith("-DGGML_VULKAN=on")
    )
    assert llama_args(tmp_path, "Darwin", "arm64", LLAMA_BACKEND="cpu").stdout.strip() == (
        "-DGGML_NATIVE=ON -DGGML_RPC=ON -DGGML_METAL=off"
    )
    own = llama_args(tmp_path, "Darwin", "arm64", LLAMA_CMAKE_ARGS="-DGGML_METAL=on -DGGML_BLAS=off")
    assert own.stdout.strip() == "-DGGML_METAL=on -DGGML_BLAS=off"


@pytest.mark.parametrize(
    "system,backend,message",
    [
        ("Linux", "rocm", "LLAMA_BACKEND='rocm': choose one of cpu, metal, cuda, vulkan"),
        ("Linux", "metal", "LLAMA_BACKEND=metal needs macOS"),
        ("Darwin", "cuda", "LLAMA_BACKEND=cuda needs nvcc"),
    ],
)
def test_impossible_backends_stop_the_build_with_a_reason(tmp_path, system, backend, message):
    out = llama_args(tmp_path, system, "arm64", LLAMA_BACKEND=backend)
    assert out.returncode != 0 and message in out.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU here builds CUDA")
def test_this_machine_builds_as_before():
    """No platform faked: on these x86-64 Linux machines without a GPU, the arguments the Makefile always used."""
    out = subprocess.run(
        ["make", "-s", "print-llama-args", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == f"-DGGML_NATIVE=ON -DGGML_RPC=ON {NO_AMX}"
