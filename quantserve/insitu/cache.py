"""The in-situ quantization cache: converted models keyed by source content, quant type and quantserve version."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from quantserve import __version__

_CHUNK = 8 << 20


def default_cache_dir() -> Path:
    env = os.environ.get("QUANTSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quantserve"


@dataclass(frozen=True)
class CacheEntry:
    key: str
    path: Path  # the converted model file
    source: str
    quant: str
    size: int
    created: float


class QuantCache:
    """`<dir>/<key>/model.gguf` plus `meta.json`. The key hashes every source file's bytes (config, tokenizer and
    weights), the quant type and the quantserve version, so an edited checkpoint or a new quantserve converts again.
    File digests are remembered by (path, size, mtime, inode), so a second start does not re-read the weights."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else default_cache_dir()

    def key(self, source_files: list[Path], quant: str) -> str:
        h = hashlib.sha256(f"quantserve {__version__}\nquant {quant.lower()}\n".encode())
        for f in sorted(source_files, key=lambda p: p.name):
            h.update(f"{f.name} {self._file_digest(f)}\n".encode())
        return h.hexdigest()[:32]

    def lookup(self, key: str) -> CacheEntry | None:
        meta = self.root / key / "meta.json"
        if not meta.is_file():
            return None
        entry = self._entry(meta)
        return entry if entry is not None and entry.path.is_file() else None

    def lock_path(self, key: str) -> Path:
        """The file lock a conversion into entry `key` holds (beside the entry, so removing it leaves the lock)."""
        return self.root / f"{key}.lock"

    def store_dir(self, key: str) -> Path:
        d = self.root / key
        d.mkdir(parents=True, exist_ok=True)
        return d

    def commit(self, key: str, model_file: Path, source: Path, quant: str) -> CacheEntry:
        meta = {
            "source": str(source),
            "quant": quant,
            "quantserve": __version__,
            "created": time.time(),
            "file": model_file.name,
        }
        tmp = self.root / key / f"meta.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(self.root / key / "meta.json")  # the entry exists only once its model file is complete
        entry = self.lookup(key)
        assert entry is not None
        return entry

    def entries(self) -> list[CacheEntry]:
        if not self.root.is_dir():
            return []
        found = [self._entry(m) for m in sorted(self.root.glob("*/meta.json"))]
        return [e for e in found if e is not None]

    def remove(self, key: str) -> bool:
        d = self.root / key
        if not d.is_dir() or d.parent != self.root:
            return False
        shutil.rmtree(d)
        return True

    def remove_source(self, source: Path) -> list[CacheEntry]:
        """Remove every conversion of the checkpoint at `source` (a directory, or a file in it); returns them."""
        directory = source if source.is_dir() else source.parent
        gone = [e for e in self.entries() if Path(e.source) == directory]
        return [e for e in gone if self.remove(e.key)]

    # ---- internals ----------------------------------------------------------------------------

    def _entry(self, meta: Path) -> CacheEntry | None:
        try:
            m = json.loads(meta.read_text())
            path = meta.parent / m["file"]
            size = sum(p.stat().st_size for p in meta.parent.iterdir() if p.is_file())
            return CacheEntry(meta.parent.name, path, m["source"], m["quant"], size, m["created"])
        except (OSError, ValueError, KeyError):
            return None

    def _file_digest(self, f: Path) -> str:
        real = f.resolve()
        # Hugging Face hub caches name blobs by their sha256 already.
        if real.parent.name == "blobs" and len(real.name) == 64:
            return real.name
        st = real.stat()
        memo_key = hashlib.sha256(f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}".encode()).hexdigest()[
            :32
        ]
        memo = self.root / "digests" / memo_key
        if memo.is_file():
            return memo.read_text().strip()
        h = hashlib.sha256()
        with real.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest)
        return digest
