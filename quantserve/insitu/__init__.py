"""In-situ quantization: a dense HF checkpoint becomes a (quantized) GGUF at load, once, kept in the cache
(cache.py) keyed by the source files and the quant type."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantserve.errors import ConfigError
from quantserve.formats import ModelSpec
from quantserve.formats.hf_config import is_llava
from quantserve.insitu.cache import QuantCache

log = logging.getLogger("quantserve.insitu")

_SIDE_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "preprocessor_config.json",  # a LLaVA's image mean and std go into its mmproj (older checkpoints)
    "processor_config.json",  # ... or here, since transformers 5 (formats.hf_config.image_processor_settings)
)
_DTYPE_QUANT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def target_type(spec: ModelSpec, quant: str | None) -> str:
    """The GGUF type a dense checkpoint converts to: `quant`, else its own dtype, losslessly."""
    return (quant or _DTYPE_QUANT.get(spec.quant.get("dtype", ""), "f16")).lower()


def ensure_gguf(
    spec: ModelSpec, quant: str | None, *, cache_dir: str | None, use_cache: bool
) -> tuple[Path, object]:
    """Return (GGUF path, keep-alive handle). Converts `spec` (dense safetensors) with `quant`, or losslessly to its
    own dtype when no quant is given. The handle owns a temporary directory when the cache is off.

    Raises:
        ConfigError: an unknown quant type (the converter's message lists the known ones).
    """
    from quantserve.gguf.hf_to_gguf import hf_to_gguf

    quant = target_type(spec, quant)
    directory = spec.path if spec.path.is_dir() else spec.path.parent
    if not use_cache:
        tmp = tempfile.TemporaryDirectory(prefix="quantserve-")
        out = Path(tmp.name) / "model.gguf"
        _convert(hf_to_gguf, directory, out, quant)
        _projector(spec, directory, out)
        return out, tmp
    cache = QuantCache(Path(cache_dir) if cache_dir else None)
    sources = list(spec.files) + [directory / n for n in _SIDE_FILES if (directory / n).is_file()]
    t = time.perf_counter()
    key = cache.key(sources, quant)
    hit = cache.lookup(key)
    if hit is None:
        # One conversion per entry, also across processes (two servers started at once on a cold cache): the
        # second waits on the entry's lock, then finds the first one's result.
        with _locked(cache.lock_path(key), f"{directory} to {quant}"):
            hit = cache.lookup(key)
            if hit is None:
                out = cache.store_dir(key) / "model.gguf"
                _convert(hf_to_gguf, directory, out, quant)
                _projector(spec, directory, out)
                entry = cache.commit(key, out, directory, quant)
    if hit is not None:
        log.info(
            "in-situ %s: cache hit %s (%.1fs to check the source)", quant, hit.path, time.perf_counter() - t
        )
        return hit.path, None
    log.info(
        "in-situ %s: cached as %s (%.1f MB); the next start skips the conversion",
        quant,
        entry.path,
        entry.size / 1e6,
    )
    return entry.path, None


@contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """Hold the file lock at `path` (filelock: released by the OS if the process dies), saying so when another
    process holds it."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is converting %s; waiting for it to finish (lock %s)", what, path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _convert(hf_to_gguf, src: Path, dst: Path, quant: str) -> None:
    log.info("in-situ quantization of %s to %s (once; progress below)", src, quant)
    t = time.perf_counter()
    try:
        hf_to_gguf(src, dst, quant, force=True)
    except ValueError as exc:  # a converter bug surfacing as ValueError is still reported, with the quant
        raise ConfigError(f"in-situ conversion to {quant} failed: {exc}") from exc
    log.info("converted in %.1fs", time.perf_counter() - t)


def _projector(spec: ModelSpec, src: Path, model_gguf: Path) -> None:
    """A LLaVA's vision projector at f16 beside its language model, where the llama.cpp backend finds it."""
    if is_llava(spec.config or {}):
        from quantserve.gguf.mmproj import hf_to_mmproj

        hf_to_mmproj(src, model_gguf.parent / "mmproj-f16.gguf", "f16", force=True)
        log.info("wrote the vision projector beside it (mmproj, f16)")
