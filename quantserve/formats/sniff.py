"""Classify a file by its first bytes (never its name): GGUF, safetensors, pickle/zip checkpoint, or other."""

from __future__ import annotations

import struct
from pathlib import Path

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.safetensors_header import MAX_HEADER_BYTES

GGUF, SAFETENSORS, PICKLE, ZIP, OTHER = "gguf", "safetensors", "pickle", "zip", "other"
SNIFF_BYTES = 16


def classify_bytes(head: bytes) -> str:
    """Name the container format from a file's first SNIFF_BYTES bytes."""
    if head[:4] == b"GGUF":
        return GGUF
    if head[:4] == b"PK\x03\x04":
        return ZIP  # torch.save's default format since 1.6 is a zip archive holding a pickle
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return PICKLE  # PROTO opcode: a raw pickle (legacy torch.save, joblib, …)
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack_from("<Q", head, 0)
        if 2 <= n <= MAX_HEADER_BYTES:
            return SAFETENSORS  # u64 header length then a JSON object
    return OTHER


def classify_file(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return classify_bytes(f.read(SNIFF_BYTES))
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror}); check the file's permissions") from None


def refuse_pickles(paths: list[Path], where: Path) -> UnsupportedFormatError:
    """The error for pickled checkpoints: loading one runs arbitrary code, so quantserve never does."""
    shown = ", ".join(f"{p.name} ({p.stat().st_size} bytes)" for p in paths[:5])
    more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
    return UnsupportedFormatError(
        f"{where}: {shown}{more} {'is a' if len(paths) == 1 else 'are'} pickled PyTorch checkpoint"
        f"{'' if len(paths) == 1 else 's'}; quantserve never unpickles files because that "
        "can run arbitrary code. Convert it to safetensors in a trusted environment (e.g. "
        "`safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')`) "
        "or download the repository's .safetensors files"
    )


def describe(paths: list[Path], limit: int = 8) -> str:
    """'a (12 bytes), b (3 bytes)' for error messages that say what was found."""
    items = [f"{p.name} ({p.stat().st_size} bytes)" for p in sorted(paths)[:limit]]
    if len(paths) > limit:
        items.append(f"… {len(paths) - limit} more")
    return ", ".join(items) if items else "nothing"
