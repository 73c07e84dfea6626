"""Read quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, Marlin) as QuantizedWeights plus dense tensors.

`open_quantized(path)` detects the format, resolves every tensor through the shard index (one layer's tensors
may sit in different shards: docs/quantized-checkpoints.md, "Detection pitfalls"), and reads tensors with
`safetensors.safe_open` (no pickle).
Which tensors form a quantized linear is decided by the tensors themselves (a `qweight`, `B` or
`weight_packed`); everything else (embeddings, norms, lm_head, `ignore`d / `modules_to_not_convert` /
GPTQModel `-:` layers) is dense. The per-layer settings come from the scheme detect() parsed (its `layer`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.detect import detect
from quantserve.formats.safetensors_header import read_safetensors_header
from quantserve.formats.spec import ModelSpec
from quantserve.kernels.qweight import QuantizedWeight

logger = logging.getLogger(__name__)


class QuantCheckpoint:
    """An opened HF checkpoint: quantized linears as QuantizedWeights, all other tensors dense.

    Attributes:
        spec: what detect() found; `config` (config.json), `format`, `quant` and `scheme` are copied from it.
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
        self.scheme = spec.scheme
        self._file: dict[str, Path] = {}
        for path in spec.files:
            self._file |= dict.fromkeys(read_safetensors_header(path).tensors, path)
        self._prefixes: list[str] = []
        owned: set[str] = set()
        if self.scheme is not None:
            self._layout = self.scheme.layout()
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
        if self.scheme is None or prefix not in self._prefixes:
            raise KeyError(f"'{prefix}' is not a quantized linear of {self.spec.directory}")
        return self._layout.decode(prefix, self._get(prefix), self.scheme.layer(prefix))

    def read_bias(self, prefix: str, *, drop_zero: bool = False) -> torch.Tensor | None:
        """The linear's bias, or None. drop_zero: also None for an all-zero bias, which AutoGPTQ <= 0.7.1 wrote
        for every projection of bias-free architectures (docs/quantized-checkpoints.md, "Detection
        pitfalls")."""
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
