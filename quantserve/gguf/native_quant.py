"""llama.cpp's own quantizers through llama-cpp-python: whole-file `llama_model_quantize` (K-quant mixes,
importance matrices) and per-tensor `ggml_quantize_chunk` (the Q6_K output matrix of a direct Q4/Q5 file).

The params struct is checked against llama-cpp-python 0.3.36's `llama_cpp.py` and the `llama.h` it vendors
(it changed layout several times, so the pinned version matters: docs/gguf.md, "Why the llama-cpp-python
version is pinned").
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType
from llama_cpp._ggml import libggml

from quantserve.formats.staging import ConversionError
from quantserve.gguf.imatrix import read_imatrix
from quantserve.gguf.quant_types import QuantTarget, n_bytes

_KV_INT, _KV_STR = 0, 3  # llama.h enum llama_model_kv_override_type

_quantize_chunk = libggml.ggml_quantize_chunk
_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
_quantize_chunk.restype = ctypes.c_size_t


def ggml_quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize float32 rows [n_rows, n_per_row] with ggml's reference quantizer (no imatrix) -> uint8 rows."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty((x.shape[0], n_bytes(qtype, (x.shape[1],))), dtype=np.uint8)
    written = _quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
    assert written == out.nbytes, (written, out.nbytes)
    return out


def _kv(key: str, value: int | str) -> llama_cpp.llama_model_kv_override:
    kv = llama_cpp.llama_model_kv_override()
    kv.key = key.encode()
    if isinstance(value, int):
        kv.tag, kv.value.val_i64 = _KV_INT, value
    else:
        kv.tag, kv.value.val_str = _KV_STR, value.encode()[:127]
    return kv


def quantize_file(src: Path, dst: Path, target: QuantTarget, imatrix: Path | None = None,
                  nthread: int | None = None, verbose: bool = True, imatrix_label: str | None = None) -> None:  # fmt: skip
    """Run llama.cpp's quantizer on an F32/F16/BF16 GGUF (what `llama-quantize src dst TYPE` does).

    Args:
        imatrix: a GGUF importance matrix from llama-imatrix; recorded in the output as quantize.imatrix.*
            keys, like llama-quantize does (quantize.imatrix.file is `imatrix_label` when given).
        verbose: let llama.cpp print its per-tensor log (its only progress report) to stderr.
    Raises:
        ConversionError: llama.cpp reported a failure (its log, on stderr, says why).
        ModelFileError: the imatrix file is malformed.
    """
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(target.ftype)
    params.nthread = nthread or os.cpu_count() or 1
    keep: list[object] = []  # ctypes buffers that must outlive the call
    if imatrix is not None:
        im = read_imatrix(imatrix)
        entries = (llama_cpp.llama_model_imatrix_data * (len(im.values) + 1))()  # zeroed: the NULL terminator
        for i, (name, values) in enumerate(im.values.items()):
            keep += [name.encode(), values]
            entries[i].name = keep[-2]
            entries[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = values.size
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        kvs = [
            _kv("quantize.imatrix.file", imatrix_label or str(imatrix)),
            _kv("quantize.imatrix.entries_count", len(im.values)),
        ]
        if im.datasets:
            kvs.append(_kv("quantize.imatrix.dataset", im.datasets[0]))
        if im.chunk_count:
            kvs.append(_kv("quantize.imatrix.chunks_count", im.chunk_count))
        overrides = (llama_cpp.llama_model_kv_override * (len(kvs) + 1))(*kvs)  # empty key terminates
        params.kv_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_kv_override))
        keep += [entries, overrides]
    # llama-cpp-python forwards llama.cpp's log to stderr when its logger's level lets INFO through
    llama_logger = logging.getLogger("llama-cpp-python")
    level = llama_logger.level
    llama_logger.setLevel(logging.INFO if verbose else logging.ERROR)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        llama_logger.setLevel(level)
    if rc != 0:
        raise ConversionError(
            f"llama.cpp's quantizer failed with code {rc} while writing {target.name.upper()} "
            "(its log above says why); check the disk space and the --imatrix file"
        )
