"""What the tensors themselves say about a quantized linear, from the safetensors header alone (no data read).

Each layout leaves a fingerprint in the shapes and dtypes of its tensors (docs/quantized-checkpoints.md,
"Telling layouts apart"), so a config that names the wrong method, or a checkpoint with no config, is caught
before a byte of weights is decoded. The helpers below also give every scheme's `check` the same error wording.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantserve.errors import ModelFileError
from quantserve.formats.safetensors_header import FLOAT_DTYPES
from quantserve.formats.spec import SafetensorsTensor

Tensors = Mapping[str, SafetensorsTensor]

LABELS = {
    "gptq": "GPTQ",
    "awq-gemm": "AWQ GEMM",
    "awq-gemv": "AWQ GEMV",
    "awq-gemv_fast": "AWQ GEMV_FAST",
    "awq-marlin": "AWQ Marlin",
    "marlin": "Marlin (B/s)",
    "compressed-tensors": "compressed-tensors",
    "fp8": "FP8",
    "unknown": "unrecognised",
}
# The tensor that marks a quantized linear, in any layout.
QUANT_SUFFIXES = ("qweight", "B", "weight_packed", "weight_scale_inv")


def fingerprint(prefix: str, t: Tensors) -> str:
    """Which layout a quantized linear's tensors have (a key of LABELS), from shapes and dtypes alone."""

    def get(suffix: str) -> SafetensorsTensor | None:
        x = t.get(f"{prefix}.{suffix}")
        return x if x is not None and len(x.shape) == 2 else None

    if (b := get("B")) is not None and (s := get("s")) is not None:
        # B is [K/16, N*bits/2]: 2N for 4-bit, 4N for 8-bit (vLLM's gptq_marlin layout)
        return "marlin" if b.shape[1] in (2 * s.shape[1], 4 * s.shape[1]) else "unknown"
    if f"{prefix}.weight_packed" in t:
        return "compressed-tensors"
    if (w := t.get(f"{prefix}.weight")) is not None and w.dtype.startswith("F8"):
        return "fp8"
    qw, sc, qz = get("qweight"), get("scales"), t.get(f"{prefix}.qzeros")
    if qw is None or sc is None:
        return "unknown"
    if qw.dtype == "I16" or (qz is not None and qz.dtype in FLOAT_DTYPES):
        return "awq-gemv_fast"
    if qw.shape[1] == sc.shape[1]:
        return "gptq"  # qweight [K*b/32, N], scales [K/G, N]
    if 8 * qw.shape[1] == sc.shape[1]:
        return "awq-gemm"  # qweight [K, N/8], scales [K/G, N]
    if qw.shape[1] == 2 * sc.shape[1]:
        return "awq-marlin"  # qweight [K/16, 2N]
    if qw.shape[0] == sc.shape[0]:
        return "awq-gemv"  # qweight [N, K/8], scales [N, 8*Wz]
    return "unknown"


def quantized_prefixes(t: Tensors, suffix: str) -> list[str]:
    tail = "." + suffix
    return sorted(name[: -len(tail)] for name in t if name.endswith(tail))


def describe_layer(prefix: str, t: Tensors) -> str:
    parts = [
        f"{n[len(prefix) + 1 :]} {x.dtype} {list(x.shape)}"
        for n, x in sorted(t.items())
        if n.startswith(prefix + ".")
    ]
    return f"'{prefix}' ({', '.join(parts)})"


def any_quantized_layer(t: Tensors) -> tuple[str, str] | None:
    """(prefix, fingerprint) of the first quantized-looking linear, whatever its format."""
    for suffix in QUANT_SUFFIXES:
        for prefix in quantized_prefixes(t, suffix):
            return prefix, fingerprint(prefix, t)
    for name, x in t.items():  # FP8 weights whose scales are named otherwise, or missing
        if x.dtype.startswith("F8") and len(x.shape) == 2:
            return name.removesuffix(".weight"), "fp8"
    return None


def int_field(qc: dict[str, Any], keys: tuple[str, ...], default: int | None, where: str) -> int:
    """The first of `keys` present in the config, as an int; `default` when none is (None: required)."""
    for key in keys:
        if qc.get(key) is not None:
            try:
                return int(qc[key])
            except (TypeError, ValueError):
                raise ModelFileError(f"{where}: {key} = {qc[key]!r} is not an integer") from None
    if default is None:
        raise ModelFileError(f"{where}: missing '{keys[0]}'; add it to the quantization config")
    return default


def layers_marked(t: Tensors, suffix: str, method: str, where: str) -> list[str]:
    """The prefixes of the linears `suffix` marks; none at all means the config names the wrong method."""
    prefixes = quantized_prefixes(t, suffix)
    if prefixes:
        return prefixes
    found = any_quantized_layer(t)
    seen = f"{LABELS[found[1]]}-shaped {describe_layer(found[0], t)}" if found else "only unquantized tensors"
    raise ModelFileError(
        f"{where} says quant_method '{method}' but no '*.{suffix}' tensors exist; found {seen}. "
        "Fix the quantization config or re-download the checkpoint"
    )


def expect(prefix: str, t: Tensors, want: str, method: str, where: str) -> None:
    got = fingerprint(prefix, t)
    if got != want:
        raise ModelFileError(
            f"{where} says quant_method '{method}' ({LABELS[want]} layout) but {describe_layer(prefix, t)} is "
            f"{LABELS[got]}-shaped; the config does not match the tensors — fix the config or re-download"
        )


def mismatch(where: str, key: str, value: Any, prefix: str, t: Tensors, implied: str) -> ModelFileError:
    return ModelFileError(
        f"{where} says {key} {value} but {describe_layer(prefix, t)} implies {implied}; "
        "fix the quantization config or re-download the checkpoint"
    )
