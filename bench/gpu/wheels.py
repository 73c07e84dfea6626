"""Download, into .whl/, the Python 3.12 manylinux wheels of every package the torch serving path, the CUDA tests
and the smoke test need that the GPU machine's image lacks. bench/gpu/run.sh installs them there with
`pip install --no-index --no-deps --target`.

The set is computed, not listed: the dependency closure of quantserve's runtime requirements plus `openai` (the smoke
test's client), with markers evaluated for CPython 3.12 on x86-64 Linux, less llama-cpp-python (the torch path needs
none of it), torch and triton (the image's own CUDA builds), and less whatever the image already has. Versions are
the ones installed in this venv, so the GPU runs what the test suite ran.

    .venv/bin/python bench/gpu/wheels.py [--dest .whl] [--max-mib 20]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

# The image 'cuda' of the H100/H200 device machines: its Python packages as the workplace's KINDS.md lists them
# (read off a machine on 2026-11-17). Only names; their versions are the image's.
IMAGE = [
    "absl-py",
    "accelerate",
    "aiofiles",
    "aiohappyeyeballs",
    "aiohttp",
    "aiosignal",
    "annotated-doc",
    "anyio",
    "attrs",
    "botorch",
    "build",
    "certifi",
    "charset-normalizer",
    "chex",
    "click",
    "cloudpickle",
    "cmake",
    "colorama",
    "contourpy",
    "coverage",
    "cuda-bindings",
    "cuda-core",
    "cuda-pathfinder",
    "cuda-toolkit",
    "cupy-cuda13x",
    "cycler",
    "cython",
    "diffrax",
    "e3nn",
    "einops",
    "equinox",
    "etils",
    "execnet",
    "filelock",
    "flatbuffers",
    "flax",
    "fonttools",
    "formulaic",
    "frozenlist",
    "fsspec",
    "gpytorch",
    "grpcio",
    "h11",
    "h5py",
    "hf-xet",
    "httpcore",
    "httpx",
    "huggingface-hub",
    "humanize",
    "hypothesis",
    "idna",
    "imageio",
    "interface-meta",
    "iniconfig",
    "jax",
    "jax-cuda13-pjrt",
    "jax-cuda13-plugin",
    "jaxlib",
    "jaxtyping",
    "jinja2",
    "joblib",
    "kiwisolver",
    "lazy-loader",
    "lightning",
    "lightning-utilities",
    "linear-operator",
    "lineax",
    "llvmlite",
    "lxml",
    "markdown",
    "markdown-it-py",
    "markupsafe",
    "matplotlib",
    "mdurl",
    "meson",
    "ml-dtypes",
    "mpi4py",
    "mpmath",
    "msgpack",
    "multidict",
    "multipledispatch",
    "mypy-extensions",
    "nanobind",
    "narwhals",
    "networkx",
    "ninja",
    "numba",
    "numba-cuda",
    "numpy",
    "numpyro",
    "nvidia-cublas",
    "nvidia-cuda-cupti",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime",
    "nvidia-cudnn-cu13",
    "nvidia-cufft",
    "nvidia-cufile",
    "nvidia-curand",
    "nvidia-cusolver",
    "nvidia-cusparse",
    "nvidia-cusparselt-cu13",
    "nvidia-ml-py",
    "nvidia-nccl-cu13",
    "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13",
    "nvidia-nvtx",
    "onnx",
    "onnx-ir",
    "onnxruntime",
    "onnxscript",
    "opencv-python-headless",
    "optax",
    "opt-einsum",
    "opt-einsum-fx",
    "optimistix",
    "orbax-checkpoint",
    "packaging",
    "pandas",
    "pathspec",
    "patsy",
    "peft",
    "pillow",
    "pip",
    "pluggy",
    "portalocker",
    "prometheus-client",
    "propcache",
    "protobuf",
    "psutil",
    "pyarrow",
    "pybind11",
    "py-cpuinfo",
    "pygments",
    "pyparsing",
    "pyproject-hooks",
    "pyre-extensions",
    "pytest",
    "pytest-benchmark",
    "pytest-cov",
    "pytest-mock",
    "pytest-timeout",
    "pytest-xdist",
    "python-dateutil",
    "pytorch-lightning",
    "pyyaml",
    "regex",
    "requests",
    "rich",
    "sacrebleu",
    "safetensors",
    "scikit-build-core",
    "scikit-image",
    "scikit-learn",
    "scipy",
    "seaborn",
    "sentencepiece",
    "sentence-transformers",
    "setuptools",
    "shellingham",
    "simplejson",
    "six",
    "sortedcontainers",
    "statsmodels",
    "sympy",
    "tabulate",
    "tensorboard",
    "tensorboard-data-server",
    "tensorstore",
    "threadpoolctl",
    "tifffile",
    "tiktoken",
    "timm",
    "tokenizers",
    "toolz",
    "torch",
    "torchaudio",
    "torchdiffeq",
    "torch-geometric",
    "torchmetrics",
    "torchvision",
    "tqdm",
    "transformers",
    "treescope",
    "triton",
    "typer",
    "typing-extensions",
    "typing-inspect",
    "urllib3",
    "uvloop",
    "wadler-lindig",
    "werkzeug",
    "wheel",
    "wrapt",
    "xarray",
    "xxhash",
    "yarl",
    "zipp",
]
NOT_CARRIED = {"llama-cpp-python", "torch", "triton"}
EXTRA_ROOTS = ["openai"]  # the smoke test asks the Paris question through the official client
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]  # fmt: skip


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> dict[str, str]:
    """name -> installed version of every distribution reachable from quantserve's runtime requirements."""
    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}  # fmt: skip
    roots = [Requirement(r) for r in md.requires("quantserve") or []]
    roots = [r for r in roots if r.marker is None or r.marker.evaluate(env)] + [
        Requirement(r) for r in EXTRA_ROOTS
    ]
    seen: dict[str, str] = {}
    todo = [r.name for r in roots]
    while todo:
        name = norm(todo.pop())
        if name in seen or name in NOT_CARRIED:
            continue
        try:
            seen[name] = md.version(name)
        except md.PackageNotFoundError:
            sys.exit(
                f"error: {name} is needed but not installed here; run `make setup` (or pip install it) first"
            )
        for spec in md.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder for the wheels (default .whl/)")
    ap.add_argument(
        "--max-mib", type=float, default=20.0, help="fail above this many MiB in all (default 20)"
    )
    args = ap.parse_args(argv)
    image = {norm(n) for n in IMAGE}
    needed = {n: v for n, v in sorted(closure().items()) if n not in image}
    if args.dest.exists():
        shutil.rmtree(args.dest)
    args.dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(args.dest)]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in needed.items()], check=True)
    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {total:.1f} MiB in {args.dest} (the image has the rest of the closure)")
    if len(wheels) != len(needed):
        print(f"error: {len(needed)} packages needed, {len(wheels)} wheels downloaded", file=sys.stderr)
        return 1
    if total > args.max_mib:
        print(f"error: {total:.1f} MiB is over --max-mib {args.max_mib}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
