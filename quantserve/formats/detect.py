"""detect(path): a model's format, weight files, config and quantization from metadata and bytes, never names."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError, ModelNotFoundError
from quantserve.formats import sniff
from quantserve.formats.gguf import read_gguf_info
from quantserve.formats.hf_config import read_json_object
from quantserve.formats.hf_quant import detect_hf, packed_experts
from quantserve.formats.safetensors_header import read_safetensors_header
from quantserve.formats.spec import GGUFInfo, ModelSpec, SafetensorsTensor

# A container handler gets (the path the user gave, the files of its kind) and returns the spec.
Container = Callable[[Path, list[Path]], ModelSpec]
CONTAINERS: dict[str, Container] = {}

# GGUF files that ride along with a model but are not one (llava projectors, LoRA adapters)
_COMPANION_TYPES = {"mmproj", "adapter"}
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})(?P<ext>.*)$")


def register_container(kind: str) -> Callable[[Container], Container]:
    def wrap(fn: Container) -> Container:
        CONTAINERS[kind] = fn
        return fn

    return wrap


def _config(directory: Path) -> dict[str, Any] | None:
    path = directory / "config.json"
    return read_json_object(path) if path.is_file() else None


def _gguf_infos(paths: list[Path], cache: dict[Path, GGUFInfo]) -> list[GGUFInfo]:
    for p in paths:
        if p not in cache:
            cache[p] = read_gguf_info(p)
    return [cache[p] for p in paths]


def _split_parts(first: GGUFInfo, siblings: list[Path], cache: dict[Path, GGUFInfo]) -> list[GGUFInfo]:
    """All parts of a split GGUF in split.no order, confirmed by their split metadata."""
    n = first.split_count
    if n <= 1:
        return [first]
    m = _SPLIT_NAME.match(first.path.name)
    named = []
    if m:  # gguf-split names only narrow the search; each part is confirmed by its own metadata below
        named = [first.path.parent / f"{m['stem']}-{i:05d}-of-{n:05d}{m['ext']}" for i in range(1, n + 1)]
    candidates = [p for p in named if p.is_file()] if m and all(p.is_file() for p in named) else siblings
    parts: dict[int, GGUFInfo] = {}
    for info in _gguf_infos(candidates, cache):
        if info.split_count == n and info.metadata.get("split.no") is not None:
            if info.split_no in parts and parts[info.split_no].path != info.path:
                raise ModelFileError(
                    f"{first.path.parent}: {parts[info.split_no].path.name} and {info.path.name} both claim to be "
                    f"split part {info.split_no + 1} of {n}; keep one split model per directory"
                )
            parts[info.split_no] = info
    missing = [i for i in range(n) if i not in parts]
    if missing:
        expected = ", ".join(named[i].name if named else f"part {i + 1}" for i in missing)
        raise ModelFileError(
            f"{first.path.name} is part {first.split_no + 1} of a {n}-part split GGUF but {len(missing)} part(s) "
            f"are missing: {expected}; download all parts into {first.path.parent}"
        )
    ordered = [parts[i] for i in range(n)]
    declared = ordered[0].get("split.tensors.count")
    total = sum(len(p.tensors) for p in ordered)
    if isinstance(declared, int) and declared != total:
        raise ModelFileError(
            f"{ordered[0].path.name}: split.tensors.count is {declared} but the {n} parts hold {total} tensors; "
            "the parts come from different models or are corrupt — download them again"
        )
    return ordered


def _is_companion(info: GGUFInfo) -> bool:
    return info.get("general.type") in _COMPANION_TYPES or info.get("general.architecture") == "clip"


@register_container(sniff.GGUF)
def _gguf_spec(path: Path, files: list[Path]) -> ModelSpec:
    cache: dict[Path, GGUFInfo] = {}
    if path.is_file():
        first = read_gguf_info(path)
        siblings = []
        if first.split_count > 1:
            siblings = [p for p in _files(path.parent) if sniff.classify_file(p) == sniff.GGUF]
        parts = _split_parts(first, siblings, cache)
        config = None  # a loose .gguf's neighbours need not belong to it
    else:
        infos = _gguf_infos(files, cache)
        models = [i for i in infos if not _is_companion(i) and (i.split_count == 1 or i.split_no == 0)]
        if not models:
            raise ModelFileError(
                f"{path}: the GGUF files here are only companions (projectors/adapters/later split parts): "
                f"{sniff.describe(files)}; add the model's own .gguf"
            )
        if len(models) > 1:
            raise ModelFileError(
                f"{path}: holds {len(models)} GGUF models ({sniff.describe([i.path for i in models])}); "
                "pass the path of the one .gguf file to use"
            )
        parts = _split_parts(models[0], files, cache)
        config = _config(path)
    first = parts[0]
    quant = {"file_type": first.file_type, "version": first.version}
    return ModelSpec("gguf", path, tuple(p.path for p in parts), config, quant, first.architecture)


def _shards_from_index(directory: Path, index_path: Path) -> tuple[list[Path], dict[str, str]]:
    index = read_json_object(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(
            f"{index_path}: 'weight_map' must be a non-empty object of tensor name -> file name"
        )
    for name, shard in weight_map.items():
        # the map comes from the internet: a shard name must not point outside the model directory
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise ModelFileError(
                f"{index_path}: tensor '{name}' maps to {shard!r}, which is not a plain file name"
            )
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        counts = {s: sum(1 for v in weight_map.values() if v == s) for s in missing}
        listed = ", ".join(f"{s} ({c} tensors)" for s, c in counts.items())
        raise ModelFileError(
            f"{index_path.name} lists {len(shards)} shards but {len(missing)} are missing from {directory}: "
            f"{listed}; download the missing shard files"
        )
    return [directory / s for s in shards], weight_map


@register_container(sniff.SAFETENSORS)
def _safetensors_spec(path: Path, files: list[Path]) -> ModelSpec:
    directory = path if path.is_dir() else path.parent
    weight_map: dict[str, str] = {}
    if path.is_dir():
        indexes = sorted(p for p in _files(directory) if p.name.endswith(".safetensors.index.json"))
        preferred = [p for p in indexes if p.name == "model.safetensors.index.json"] or indexes
        if len(preferred) > 1:
            raise ModelFileError(
                f"{directory}: several shard indexes ({sniff.describe(indexes)}); keep one model here"
            )
        if preferred:
            files, weight_map = _shards_from_index(directory, preferred[0])
    else:
        files = [path]
    tensors: dict[str, SafetensorsTensor] = {}
    owner: dict[str, Path] = {}
    metadata: dict[str, str] = {}
    for f in files:
        kind = sniff.classify_file(f)
        if kind != sniff.SAFETENSORS:
            raise ModelFileError(
                f"{f}: expected a safetensors shard but its bytes say {kind}; download it again"
            )
        header = read_safetensors_header(f)
        metadata = metadata or header.metadata
        for name, t in header.tensors.items():
            if name in tensors:
                raise ModelFileError(
                    f"{directory}: tensor '{name}' is in both {owner[name].name} and {f.name}; "
                    "keep one checkpoint per directory"
                )
            tensors[name], owner[name] = t, f
    for name, shard in weight_map.items():
        if name not in owner or owner[name].name != shard:
            raise ModelFileError(
                f"{directory}: the index maps tensor '{name}' to {shard}, but that shard lacks it"
            )
    config = _config(directory)
    scheme, dtype = detect_hf(config, directory, tensors, metadata)
    fmt, quant = (scheme.name, scheme.describe()) if scheme else ("safetensors", {"dtype": dtype})
    if scheme is None and packed_experts(config, directory, metadata):  # gpt-oss as released
        quant["experts"] = "mxfp4"
    arch = None
    if config:
        archs = config.get("architectures")
        arch = config.get("model_type") or (archs[0] if isinstance(archs, list) and archs else None)
    return ModelSpec(fmt, path, tuple(files), config, quant, str(arch) if arch else None, scheme)


def _files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.is_file())
    except OSError as e:
        raise ModelFileError(f"{directory}: cannot list the directory ({e.strerror})") from None


def detect(path: str | os.PathLike[str]) -> ModelSpec:
    """Detect a model's format from a file (GGUF or one .safetensors) or a model directory.

    Raises:
        ModelNotFoundError: the path does not exist.
        UnsupportedFormatError: pickled checkpoints, unsupported quant methods or layouts.
        ModelFileError: no weights, mixed formats, configs that contradict the tensors, corrupt files.
    """
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or directory")
    if path.is_file():
        kind = sniff.classify_file(path)
        if kind in CONTAINERS:
            return CONTAINERS[kind](path, [path])
        if kind in (sniff.PICKLE, sniff.ZIP):
            raise sniff.refuse_pickles([path], path.parent)
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
        raise ModelFileError(
            f"{path}: not a model file ({size} bytes, starts with {head!r}); quantserve reads GGUF and safetensors"
        )
    if not path.is_dir():
        raise ModelFileError(f"{path}: neither a regular file nor a directory")
    entries = _files(path)
    by_kind: dict[str, list[Path]] = {}
    for p in entries:
        by_kind.setdefault(sniff.classify_file(p), []).append(p)
    found = [k for k in CONTAINERS if k in by_kind]
    if len(found) > 1:
        listed = "; ".join(f"{k}: {sniff.describe(by_kind[k])}" for k in found)
        raise ModelFileError(f"{path}: mixes model formats ({listed}); keep one model per directory")
    if found:
        return CONTAINERS[found[0]](path, by_kind[found[0]])
    pickles = by_kind.get(sniff.PICKLE, []) + by_kind.get(sniff.ZIP, [])
    if pickles:
        raise sniff.refuse_pickles(pickles, path)
    if not entries:
        raise ModelFileError(
            f"{path}: the directory is empty; download the model's .gguf or .safetensors files"
        )
    raise ModelFileError(
        f"{path}: no weights found (saw {sniff.describe(entries)}); expected a GGUF file or safetensors weights"
    )
