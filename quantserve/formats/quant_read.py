"""Read quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, Marlin) as QuantizedWeights plus dense tensors.

`open_quantized(path)` detects the format, resolves every tensor through the shard index (one layer's tensors
may sit in different shards, FORMATS.md §6.4), and reads tensors with `safetensors.safe_open` (no pickle).
Which tensors form a quantized linear is decided by the tensors themselves (a `qweight`, `B` or
`weight_packed`); everything else (embeddings, norms, lm_head, `ignore`d / `modules_to_not_convert` /
GPTQModel `-:` layers) is dense. The per-layer settings come from the config, per-module overrides applied.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.detect import detect
from quantserve.formats.hf_config import find_quant_config
from quantserve.formats.quant_tensors import LAYOUTS, LayerQuant
from quantserve.formats.safetensors_header import read_safetensors_header
from quantserve.formats.spec import ModelSpec
from quantserve.kernels.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

Settings = Callable[[str], LayerQuant]  # layer prefix -> its settings
# (quantization config, spec.quant) -> (layout key in LAYOUTS, per-layer settings)
Scheme = Callable[[dict[str, Any], dict[str, Any]], tuple[str, Settings]]
SCHEMES: dict[str, Scheme] = {}


def register_scheme(fmt: str) -> Callable[[Scheme], Scheme]:
    """Register the config interpretation for a detect() format; a new format is one new function."""

    def wrap(fn: Scheme) -> Scheme:
        SCHEMES[fmt] = fn
        return fn

    return wrap


@register_scheme("gptq")
def _gptq(qc: dict[str, Any], quant: dict[str, Any]) -> tuple[str, Settings]:
    explicit = qc.get("checkpoint_format") or qc.get("format")
    zero_format = "v2" if quant["checkpoint_format"] == "gptq_v2" else ("v1" if explicit else "auto")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ModelFileError(f"GPTQ 'dynamic' must be an object of regex -> overrides, got {dynamic!r}")
    base = LayerQuant(
        quant["bits"], quant["group_size"], quant["sym"], zero_format, from_shapes=bool(dynamic)
    )

    def settings(prefix: str) -> LayerQuant:
        # GPTQModel dynamic_get: the first matching rule wins; "-:" skips the module (left dense), "+:" or no
        # prefix overrides bits/group_size/sym (ModelCloud/GPTQModel:gptqmodel/quantization/config.py)
        for pattern, over in dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], prefix):
                    logger.warning(
                        "%s has qweight although dynamic rule %r skips it; trusting the tensors",
                        prefix,
                        pattern,
                    )
                    return base
            elif re.match(pattern.removeprefix("+:"), prefix):
                over = over if isinstance(over, dict) else {}
                return replace(
                    base,
                    bits=int(over.get("bits", base.bits)),
                    group_size=int(over.get("group_size", base.group_size)),
                    sym=bool(over.get("sym", base.sym)),
                )
        return base

    return "gptq", settings


_AWQ_LAYOUTS = {"gemm": "awq-gemm", "exllama": "awq-gemm", "ipex": "awq-gemm", "gemv": "awq-gemv"}


@register_scheme("awq")
def _awq(qc: dict[str, Any], quant: dict[str, Any]) -> tuple[str, Settings]:
    version = quant["version"]
    if version not in _AWQ_LAYOUTS:
        raise UnsupportedFormatError(
            f"AWQ version '{version}' (its int16/F16 or pre-permuted Marlin tensors, FORMATS.md §2.3) is not "
            "supported; re-export the model as AWQ 'gemm' (AutoAWQ's default) or as GPTQ"
        )
    lq = LayerQuant(quant["bits"], quant["group_size"], sym=False)
    return _AWQ_LAYOUTS[version], lambda prefix: lq


@register_scheme("marlin")
def _marlin(qc: dict[str, Any], quant: dict[str, Any]) -> tuple[str, Settings]:
    lq = LayerQuant(quant["bits"], quant["group_size"])  # bits are re-derived from B's width per layer
    return "marlin", lambda prefix: lq


def _version(text: Any) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)", str(text or ""))
    return (int(m[1]), int(m[2])) if m else None


def _ct_matches(target: str, prefix: str) -> bool:
    """compressed-tensors target matching: 're:' regexes, module names, or a class name ('Linear')."""
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return target == "Linear" or target == prefix or prefix.endswith("." + target)


@register_scheme("compressed-tensors")
def _compressed_tensors(qc: dict[str, Any], quant: dict[str, Any]) -> tuple[str, Settings]:
    version = _version(qc.get("version"))
    # dense bitstream from compressed-tensors 0.18.0 (§5.2); without a version the tensor width decides
    packing = "auto" if version is None else ("dense" if version >= (0, 18) else "word")
    schemes = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    parsed: list[tuple[list[str], LayerQuant]] = []
    for g in schemes:
        w = g.get("weights")
        if not isinstance(w, dict):
            continue
        strategy = str(w.get("strategy") or "tensor")
        if strategy not in ("group", "channel"):
            raise UnsupportedFormatError(
                f"compressed-tensors weight strategy '{strategy}' is not supported (group or channel); "
                "re-export with llm-compressor's W4A16 scheme"
            )
        group = int(w["group_size"]) if strategy == "group" and w.get("group_size") else -1
        lq = LayerQuant(int(w["num_bits"]), group, bool(w.get("symmetric", True)), packing=packing)
        parsed.append(([str(t) for t in g.get("targets") or ["Linear"]], lq))

    def settings(prefix: str) -> LayerQuant:
        for targets, lq in parsed:
            if any(_ct_matches(t, prefix) for t in targets):
                return lq
        return parsed[0][1]

    return "compressed-tensors", settings


class QuantCheckpoint:
    """An opened HF checkpoint: quantized linears as QuantizedWeights, all other tensors dense.

    Attributes:
        spec: what detect() found; `config` (config.json) and `format` / `quant` are copied from it.
        quantization_config: the raw quantization config (config.json, quantize_config.json, ...), or {}.
    """

    def __init__(self, spec: ModelSpec):
        if spec.format == "gguf":
            raise UnsupportedFormatError(
                f"{spec.path} is GGUF; open it with the GGUF reader, not open_quantized"
            )
        self.spec = spec
        self.config: dict[str, Any] = spec.config or {}
        self.format = spec.format
        self.quant: dict[str, Any] = dict(spec.quant)
        self._file: dict[str, Path] = {}
        metadata: dict[str, str] = {}
        for path in spec.files:
            header = read_safetensors_header(path)
            metadata = metadata or header.metadata
            self._file |= dict.fromkeys(header.tensors, path)
        qc, _ = find_quant_config(spec.config, spec.directory, metadata)
        self.quantization_config: dict[str, Any] = qc or {}
        self._settings: Settings | None = None
        self._prefixes: list[str] = []
        owned: set[str] = set()
        if spec.format in SCHEMES:
            layout_key, self._settings = SCHEMES[spec.format](self.quantization_config, self.quant)
            self._layout = LAYOUTS[layout_key]
            tail = "." + self._layout.marker
            self._prefixes = sorted(n[: -len(tail)] for n in self._file if n.endswith(tail))
            for p in self._prefixes:
                owned |= {f"{p}.{s}" for s in (*self._layout.suffixes, "bias")}
        self._dense = [n for n in self._file if n not in owned]
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    # ---- tensors ---------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return list(self._file)

    def read_tensor(self, name: str) -> torch.Tensor:
        """Any tensor by name, as stored (through the shard index)."""
        path = self._file.get(name)
        if path is None:
            raise ModelFileError(f"{self.spec.directory}: no tensor '{name}' in {len(self._file)} tensors")
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path].get_tensor(name)

    def _get(self, prefix: str) -> Callable[[str], torch.Tensor | None]:
        return lambda suffix: (
            self.read_tensor(f"{prefix}.{suffix}") if f"{prefix}.{suffix}" in self._file else None
        )

    # ---- public API ------------------------------------------------------------------------------

    def linear_prefixes(self) -> list[str]:
        """Module names of the quantized linears, e.g. 'model.layers.0.self_attn.q_proj'."""
        return list(self._prefixes)

    def read_linear(self, prefix: str) -> QuantizedWeight:
        """The canonical QuantizedWeight of one quantized linear.

        Raises:
            ModelFileError: a tensor is missing or has a shape that contradicts the config (names both).
            UnsupportedFormatError: a bit width QuantizedWeight cannot hold.
        """
        if self._settings is None or prefix not in self._prefixes:
            raise KeyError(f"'{prefix}' is not a quantized linear of {self.spec.directory}")
        return self._layout.decode(prefix, self._get(prefix), self._settings(prefix))

    def read_bias(self, prefix: str, *, drop_zero: bool = False) -> torch.Tensor | None:
        """The linear's bias, or None. drop_zero: also None for an all-zero bias, which AutoGPTQ <= 0.7.1 wrote
        for every projection of bias-free architectures (FORMATS.md §6.4)."""
        name = f"{prefix}.bias"
        if name not in self._file:
            return None
        bias = self.read_tensor(name)
        return None if drop_zero and not bool(bias.any()) else bias

    def dense_names(self) -> list[str]:
        """Every tensor that is not part of a quantized linear (nor its bias), in file order."""
        return list(self._dense)

    def read_dense(self, name: str) -> torch.Tensor:
        if name not in self._dense:
            raise KeyError(f"'{name}' is not a dense tensor of {self.spec.directory}")
        return self.read_tensor(name)

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def __enter__(self) -> QuantCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_quantized(spec_or_path: ModelSpec | str | os.PathLike[str]) -> QuantCheckpoint:
    """Open a GPTQ / AWQ / compressed-tensors / Marlin (or dense safetensors) checkpoint.

    Raises:
        ModelNotFoundError, ModelFileError, UnsupportedFormatError: from detect() or the config.
    """
    spec = spec_or_path if isinstance(spec_or_path, ModelSpec) else detect(spec_or_path)
    return QuantCheckpoint(spec)
