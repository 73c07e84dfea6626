"""Atomic outputs: write into a temporary sibling of the destination, rename at the end, remove on failure."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantserve.errors import ConfigError, QuantserveError


class ConversionError(QuantserveError):
    """The conversion could not be written (disk full, destination unwritable)."""

    http_status = 507
    error_type = "server_error"
    code = "conversion_failed"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_destination(dst: Path, force: bool) -> None:
    """Raise ConfigError when dst exists and force is off."""
    if dst.exists() and not force:
        raise ConfigError(f"{dst} already exists; pass --force to overwrite it, or choose another --dst")


def ensure_free_space(directory: Path, need: int, what: str) -> None:
    """Fail before writing anything when the disk clearly cannot hold `need` bytes."""
    directory = next(
        p for p in (directory, *directory.parents) if p.exists()
    )  # dst's parents may not exist yet
    free = shutil.disk_usage(directory).free
    if free < need:
        raise ConversionError(
            f"{what} needs about {_gib(need)} in {directory} but only {_gib(free)} is free; "
            "free some space or choose a --dst on another disk"
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sibling(dst: Path, tag: str) -> Path:
    """A hidden, unique path in dst's directory (same filesystem, so the final rename is atomic)."""
    return dst.parent / f".{dst.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


@contextmanager
def disk_errors(target: Path) -> Iterator[None]:
    """Turn a full disk or quota into ConversionError naming the file."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConversionError(
                f"no space left on the device while writing {target}; free some space or choose a --dst "
                "on another disk (nothing was left behind)"
            ) from None
        raise


@contextmanager
def temporary_sibling(dst: Path, tag: str) -> Iterator[Path]:
    """A scratch file next to dst (e.g. the F16 GGUF before llama.cpp quantizes it), always removed."""
    path = sibling(dst, tag)
    try:
        yield path
    finally:
        _remove(path)


@contextmanager
def staged_output(dst: Path, *, directory: bool, force: bool) -> Iterator[Path]:
    """Yield a temporary path for the output; on success it replaces dst, on any failure it is removed.

    Raises:
        ConfigError: dst exists and force is off.
        ConversionError: the disk filled up.
    """
    check_destination(dst, force)
    made = [p for p in (dst.parent, *dst.parent.parents) if not p.exists()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(dst, "partial")
    try:
        if directory:
            tmp.mkdir()
        with disk_errors(dst):
            yield tmp
        if dst.exists() and (directory or dst.is_dir()):
            # a directory cannot be replaced in one rename: move the old one aside first
            old = sibling(dst, "old")
            os.replace(dst, old)
            os.replace(tmp, dst)
            _remove(old)
        else:
            os.replace(tmp, dst)
    except BaseException:
        _remove(tmp)
        for p in made:  # parents we created, innermost first
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        raise
