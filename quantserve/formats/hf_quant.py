"""HF safetensors checkpoints: a quantized one's scheme (parsed and checked, quantserve.formats.schemes), or a
dense one's dtype."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.hf_config import find_quant_config, quant_method_of
from quantserve.formats.safetensors_header import FLOAT_DTYPES
from quantserve.formats.schemes import QuantScheme, quant_methods, scheme_for_method
from quantserve.formats.schemes.fingerprint import LABELS, Tensors, any_quantized_layer, describe_layer


def detect_hf(
    config: dict[str, Any] | None, directory: Path, t: Tensors, st_metadata: Mapping[str, str]
) -> tuple[QuantScheme | None, str | None]:
    """The quantization scheme of a safetensors checkpoint (parsed and checked against its tensor table), or
    None and the dtype of a dense one."""
    qc, where = find_quant_config(config, directory, st_metadata)
    packed = packed_experts(config, directory, st_metadata)
    if packed:  # float weights but for the experts, which the model reads as they ship
        t = _mxfp4_checked(t, where)
    elif qc is not None:
        method = quant_method_of(qc)
        scheme = scheme_for_method(method)
        if scheme is None:
            raise UnsupportedFormatError(
                f"{where} has quant_method '{method or '(missing)'}', which quantserve does not "
                f"support (supported: {', '.join(quant_methods())}); use a GPTQ/AWQ/GGUF build of the model"
            )
        parsed = scheme.parse(qc, where)
        parsed.check(t, where)
        return parsed, None
    found = None if packed else any_quantized_layer(t)
    if found:
        raise ModelFileError(
            f"{directory}: {describe_layer(found[0], t)} is {LABELS[found[1]]}-quantized but there is no "
            "quantization config (config.json quantization_config, quantize_config.json or quant_config.json); "
            "add the config from the original repository"
        )
    dtypes: dict[str, int] = {}
    for x in t.values():
        if len(x.shape) >= 2:
            dtypes[x.dtype] = dtypes.get(x.dtype, 0) + 1
    dtype = max(dtypes, key=dtypes.__getitem__) if dtypes else None
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedFormatError(
            f"{directory}: unquantized weights must be F16, BF16 or F32 but the matrices are {dtypes or 'absent'} "
            "and there is no quantization config; convert the checkpoint to fp16/bf16 safetensors"
        )
    return None, FLOAT_DTYPES[dtype]


MXFP4 = (
    "mxfp4"  # gpt-oss's quant_method: its experts are MXFP4 (kernels/mxfp4.py), every other tensor a float
)
_PACKED = ("_blocks", "_scales")


def packed_experts(config: dict[str, Any] | None, directory: Path, st_metadata: Mapping[str, str]) -> bool:
    """Whether the checkpoint is gpt-oss as released: its quantization config says MXFP4 (the experts). Another
    model saying so is left to detect_hf, which names the method as one quantserve does not read."""
    qc, _ = find_quant_config(config, directory, st_metadata)
    return qc is not None and quant_method_of(qc) == MXFP4 and (config or {}).get("model_type") == "gpt_oss"


def _mxfp4_checked(t: Tensors, where: str) -> Tensors:
    """The tensors but the MXFP4 ones, once each `*_blocks` [..., N, K/32, 16] is found with its `*_scales`
    [..., N, K/32], both uint8.

    Raises:
        ModelFileError: no MXFP4 tensors, or blocks and scales that do not match.
    """
    blocks = [n for n in t if n.endswith("_blocks")]
    if not blocks:
        raise ModelFileError(f"{where} says quant_method 'mxfp4' but no '*_blocks' tensors exist")
    for name in blocks:
        scales = t.get(name.removesuffix("_blocks") + "_scales")
        b = t[name]
        if scales is None or b.dtype != "U8" or scales.dtype != "U8" or b.shape[-1:] != (16,) or (
            b.shape[:-1] != scales.shape
        ):  # fmt: skip
            raise ModelFileError(
                f"{name} ({b.dtype} {b.shape}) has no matching uint8 scales of shape {b.shape[:-1]} "
                f"(found {scales.dtype + ' ' + str(scales.shape) if scales is not None else 'none'}); MXFP4 "
                "blocks are [..., N, K/32, 16] and their scales [..., N, K/32]: the checkpoint is damaged"
            )
    return {n: x for n, x in t.items() if not n.endswith(_PACKED)}
