"""Write a quantized HF model directory: the format writer registry, sharded safetensors, config and tokenizer.

`write_quantized` streams (prefix, QuantizedWeight, bias) triples and dense tensors into safetensors shards
(one layer in memory at a time), then writes config.json with the format's quantization_config and copies the
tokenizer files, so the result is a complete model. Everything is written into a staging directory that
replaces `dst` only on success (formats/staging.py). Each format is one module of this package that registers
a `LayerEncoder` here. Section names refer to docs/quantized-checkpoints.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch

from quantserve.errors import ConfigError
from quantserve.formats.hf_config import TOKENIZER_FILES
from quantserve.formats.staging import staged_output
from quantserve.kernels.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

SHARD_BYTES = 2 * 10**9  # like transformers' max_shard_size="2GB"
_ST_DTYPES = {
    torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32",
    torch.int64: "I64", torch.int16: "I16", torch.uint8: "U8", torch.int8: "I8",
}  # fmt: skip

Layer = tuple[str, QuantizedWeight, torch.Tensor | None]


@dataclass(frozen=True)
class WriteOptions:
    """Format choices and provenance for write_quantized.

    Attributes:
        checkpoint_format: GPTQ only: "gptq" (v1, zeros minus one) or "gptq_v2" (raw zeros); None = v1 for
            symmetric weights, gptq_v2 for asymmetric ones ("GPTQ zero points").
        act_order: compressed-tensors only: write weight_g_idx for every layer (actorder "group"); None = as
            the first layer has it. Layers without g_idx then get the trivial one.
        scale_dtype: dtype of the written scales; None = float16 for GPTQ, AWQ and Marlin (what AutoGPTQ,
            AutoAWQ and candle-vllm write), the given float16/bfloat16 for compressed-tensors (model dtype).
        ct_version: compressed-tensors `version` to record; < 0.18 means word packing for 3-bit
            ("compressed-tensors packing").
        modules_to_not_convert: linears left dense on purpose (AWQ modules_to_not_convert, CT ignore, GPTQ
            `-:` dynamic rules); dense 2-D weights of a quantized module kind are added automatically.
        damp_percent, true_sequential, static_groups, quantizer: GPTQ provenance for the config.
        shard_bytes: start a new model-0000i-of-0000n.safetensors shard beyond this size.
        force: replace an existing dst.
    """

    checkpoint_format: str | None = None
    act_order: bool | None = None
    scale_dtype: torch.dtype | None = None
    ct_version: str = "0.12.2"
    modules_to_not_convert: tuple[str, ...] = ()
    damp_percent: float | None = None
    true_sequential: bool | None = None
    static_groups: bool = False
    quantizer: str | None = None
    shard_bytes: int = SHARD_BYTES
    force: bool = False


class LayerEncoder(ABC):
    """Base of a format writer: turns layers into named tensors, then states the quantization_config.

    The first layer fixes bits, group size and symmetry, which the format's config states once for all
    layers; `check_uniform` rejects a later layer that differs, naming both.
    """

    fmt = ""
    uniform_sym = True  # False where the format can state symmetric weights as zero = 2^(bits-1) (AWQ)
    per_module = False  # True where the format states other bits/group sizes per module (GPTQ's `dynamic`)

    def __init__(self, options: WriteOptions):
        self.options = options
        self.first: tuple[str, int, int, bool] | None = None  # prefix, bits, group_size, symmetric
        self.act_order = False  # any layer with a non-trivial g_idx
        self.settings: dict[str, tuple[int, int]] = {}  # prefix -> (bits, group_size)

    def check_uniform(self, prefix: str, w: QuantizedWeight) -> None:
        w.validate(prefix)
        key = (w.bits, w.group_size, w.symmetric or not self.uniform_sym)
        if self.first is None:
            self.first = (prefix, *key)
        elif key != self.first[1:]:
            p0, b0, g0, s0 = self.first
            if not (self.per_module and key[2] == s0):
                raise ConfigError(
                    f"{self.fmt} states {'symmetry' if self.per_module else 'bits/group_size/sym'} once per "
                    f"model, but '{prefix}' is {w.bits}-bit group {w.group_size} {'sym' if w.symmetric else 'asym'}"
                    f" while '{p0}' is {b0}-bit group {g0} {'sym' if s0 else 'asym'}; quantize all layers alike"
                )
        self.settings[prefix] = (w.bits, w.group_size)
        self.act_order |= w.with_trivial_g_idx_dropped().g_idx is not None

    def base_and_overrides(self) -> tuple[tuple[int, int], dict[str, tuple[int, int]]]:
        """The (bits, group_size) most linears have, which the config states, and the modules that differ."""
        counts: dict[tuple[int, int], int] = {}
        for setting in self.settings.values():
            counts[setting] = counts.get(setting, 0) + 1
        base = max(counts, key=lambda s: (counts[s], s == self.settings[self.first[0]]))  # ties: the first's
        return base, {p: s for p, s in self.settings.items() if s != base}

    def scales(self, prefix: str, s: torch.Tensor, default: torch.dtype) -> torch.Tensor:
        dtype = self.options.scale_dtype or default
        out = s.to(dtype)
        if out.dtype != s.dtype and not torch.equal(out.to(s.dtype), s):
            logger.warning("%s: scales are not exactly representable in %s (pass scale_dtype)", prefix, dtype)
        return out.contiguous()

    @abstractmethod
    def encode(
        self, prefix: str, w: QuantizedWeight, bias: torch.Tensor | None
    ) -> list[tuple[str, torch.Tensor]]:
        """The layer's tensors, named as the format stores them."""

    @abstractmethod
    def quantization_config(self, left_dense: list[str]) -> dict[str, Any]:
        """config.json's quantization_config for every layer encoded so far."""

    def extra_json(self, qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Further JSON files of the directory (GPTQ's quantize_config.json)."""
        return {}


@cache
def writers() -> dict[str, type[LayerEncoder]]:
    """Every format writer by its format name, each module imported on the first call. A new format is its file
    plus one line here."""
    from quantserve.converters.hf_quant.awq import AWQEncoder
    from quantserve.converters.hf_quant.compressed_tensors import CTEncoder
    from quantserve.converters.hf_quant.gptq import GPTQEncoder
    from quantserve.converters.hf_quant.marlin import MarlinEncoder

    return {cls.fmt: cls for cls in (AWQEncoder, CTEncoder, GPTQEncoder, MarlinEncoder)}


class ShardedWriter:
    """Stream tensors into safetensors shards without holding them: each shard's data goes to a spool file,
    and the header (which lists offsets, so must come first) is written in front of it when the shard closes."""

    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES):
        self.directory, self.shard_bytes = directory, shard_bytes
        self.shards: list[tuple[Path, list[str]]] = []  # finished: (temp file, tensor names)
        self._entries: dict[str, dict[str, Any]] = {}
        self._spool: IO[bytes] | None = None
        self._size = self.total = 0
        self._seen: set[str] = set()

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._seen:
            raise ConfigError(f"tensor '{name}' was given twice; each name must be written once")
        if t.dtype not in _ST_DTYPES:
            raise ConfigError(f"tensor '{name}': dtype {t.dtype} cannot be written to safetensors here")
        self._seen.add(name)
        data = t.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy()
        if self._entries and self._size + raw.nbytes > self.shard_bytes:
            self._finish()
        if self._spool is None:
            self._spool = (self.directory / f".shard-{len(self.shards)}.data").open("w+b")
        self._entries[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self._size, self._size + raw.nbytes],
        }
        self._spool.write(raw.data)
        self._size += raw.nbytes
        self.total += raw.nbytes

    def _finish(self) -> None:
        assert self._spool is not None
        header = json.dumps(
            {"__metadata__": {"format": "pt"}} | self._entries, separators=(",", ":")
        ).encode()
        header += b" " * (
            -len(header) % 8
        )  # the data section starts 8-byte aligned, as safetensors writes it
        path = self.directory / f".shard-{len(self.shards)}.safetensors"
        with path.open("wb") as out:
            out.write(struct.pack("<Q", len(header)) + header)
            self._spool.seek(0)
            shutil.copyfileobj(self._spool, out, 16 << 20)
        self._spool.close()
        os.unlink(self._spool.name)
        self.shards.append((path, list(self._entries)))
        self._spool, self._entries, self._size = None, {}, 0

    def close(self) -> list[str]:
        """Finish the last shard, give the shards their final names, write the index when there are several."""
        if self._spool is not None:
            self._finish()
        n = len(self.shards)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        )
        weight_map = {}
        for (tmp, tensors), name in zip(self.shards, names, strict=True):
            os.replace(tmp, self.directory / name)
            weight_map |= dict.fromkeys(tensors, name)
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names

    def abort(self) -> None:
        if self._spool is not None:
            self._spool.close()


def _left_dense(dense_2d: list[str], quantized: list[str], explicit: tuple[str, ...]) -> list[str]:
    """Linears written dense although their kind is quantized elsewhere (e.g. one layer's down_proj)."""
    kinds = {p.rsplit(".", 1)[-1] for p in quantized}
    auto = [n for n in dense_2d if n.rsplit(".", 1)[-1] in kinds]
    return sorted(set(explicit) | set(auto))


def write_quantized(
    dst: str | os.PathLike[str],
    fmt: str,
    layers: Iterable[Layer],
    dense: Iterable[tuple[str, torch.Tensor]],
    base_config: dict[str, Any],
    tokenizer_src_dir: str | os.PathLike[str] | None = None,
    *,
    options: WriteOptions | None = None,
) -> Path:
    """Write a complete quantized model directory in `fmt` ("gptq", "awq", "compressed-tensors", "marlin").

    Args:
        dst: the output directory (created; replaced only with options.force).
        layers: (module prefix, QuantizedWeight, bias or None), consumed one at a time.
        dense: (tensor name, float tensor) for embeddings, norms, lm_head and linears left unquantized;
            written in their own dtype. lm_head.weight is skipped when base_config ties the embeddings.
        base_config: the model's config.json; quantization_config is replaced.
        tokenizer_src_dir: copy TOKENIZER_FILES found there.
    Returns:
        dst as a Path.
    Raises:
        ConfigError: unknown format, layers the format cannot represent, dst exists without force.
        ConversionError: the disk filled up (nothing is left behind).
    """
    options = options or WriteOptions()
    known = writers()
    if fmt not in known:
        raise ConfigError(f"unknown quantized output format '{fmt}' (known: {', '.join(sorted(known))})")
    encoder = known[fmt](options)
    dst = Path(dst)
    tied = bool(base_config.get("tie_word_embeddings"))
    with staged_output(dst, directory=True, force=options.force) as tmp:
        out = ShardedWriter(tmp, options.shard_bytes)
        quantized: list[str] = []
        dense_2d: list[str] = []
        try:
            for prefix, w, bias in layers:
                for name, t in encoder.encode(prefix, w, bias):
                    out.add(name, t)
                quantized.append(prefix)
            for name, t in dense:
                if tied and name == "lm_head.weight":
                    continue  # safetensors cannot share storage; loaders re-tie it ("Detection pitfalls")
                if not t.is_floating_point():
                    raise ConfigError(f"dense tensor '{name}' is {t.dtype}; dense tensors must be float")
                out.add(name, t)
                if t.dim() == 2 and name.endswith(".weight"):
                    dense_2d.append(name[: -len(".weight")])
            if not quantized:
                raise ConfigError(f"no quantized layers were given; a {fmt} checkpoint needs at least one")
            out.close()
        except BaseException:
            out.abort()
            raise
        qc = encoder.quantization_config(_left_dense(dense_2d, quantized, options.modules_to_not_convert))
        config = {
            k: v for k, v in base_config.items() if k not in ("quantization_config", "compression_config")
        }
        config["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, obj in encoder.extra_json(qc).items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        if tokenizer_src_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_src_dir) / name
                if src.is_file():
                    shutil.copyfile(src, tmp / name)
    return dst
