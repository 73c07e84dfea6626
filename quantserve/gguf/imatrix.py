"""Read a GGUF importance matrix (llama-imatrix's output) into the per-tensor arrays llama_model_quantize takes.

Format (llama.cpp common/imatrix-loader.cpp): F32 tensors `<weight>.in_sum2` (sums of squared activations,
ne = [n_per_row, n_experts]) and `<weight>.counts` (activations seen, one per expert), plus
`imatrix.datasets` / `imatrix.chunk_count` / `imatrix.chunk_size` keys. Like llama-quantize, each expert's
sums are divided by its count, and an expert never seen gets ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from quantserve.errors import ModelFileError
from quantserve.formats import read_gguf_info

_REQUIRED_KEYS = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")


@dataclass(frozen=True, eq=False)
class ImportanceMatrix:
    values: dict[str, np.ndarray]  # GGUF weight name -> float32 [n_experts * n_per_row]
    datasets: list[str]
    chunk_count: int


def read_imatrix(path: Path) -> ImportanceMatrix:
    """Load and normalize an imatrix GGUF.

    Raises:
        ModelFileError: not a GGUF imatrix (a legacy .dat file included), mismatched or non-F32 tensors.
    """
    try:
        info = read_gguf_info(path)
    except ModelFileError as e:
        raise ModelFileError(
            f"{e.message}. --imatrix takes the GGUF file a current llama-imatrix writes; regenerate a legacy "
            ".dat file with `llama-imatrix --in-file OLD.dat -o NEW.gguf`"
        ) from None
    missing = [k for k in _REQUIRED_KEYS if k not in info.metadata]
    if missing:
        raise ModelFileError(f"{path.name}: not an importance matrix (missing metadata {', '.join(missing)})")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    arrays: dict[str, np.ndarray] = {}
    for t in info.tensors:
        if t.ggml_type != GGMLQuantizationType.F32:
            raise ModelFileError(f"{path.name}: imatrix tensor '{t.name}' is {t.type_name}; it must be F32")
        arrays[t.name] = mm[t.offset : t.offset + t.n_bytes].view(np.float32)
    values: dict[str, np.ndarray] = {}
    for name in sorted(n.removesuffix(".in_sum2") for n in arrays if n.endswith(".in_sum2")):
        sums, counts = arrays[f"{name}.in_sum2"], arrays.get(f"{name}.counts")
        if counts is None or sums.size % counts.size:
            raise ModelFileError(
                f"{path.name}: '{name}' has sums but no matching counts; regenerate the imatrix"
            )
        per = sums.reshape(counts.size, -1).astype(np.float32)
        seen = np.rint(counts).astype(np.int64)  # llama.cpp stores counts as float and rounds them back
        per = np.where(seen[:, None] > 0, per / np.maximum(seen, 1)[:, None], np.float32(1.0))
        if not np.isfinite(per).all():
            raise ModelFileError(
                f"{path.name}: '{name}' contains NaN or infinite values; regenerate the imatrix"
            )
        values[name] = np.ascontiguousarray(per.reshape(-1), dtype=np.float32)
    if not values:
        raise ModelFileError(f"{path.name}: the importance matrix holds no '<weight>.in_sum2' tensors")
    datasets = info.metadata.get("imatrix.datasets") or []
    return ImportanceMatrix(
        values, [str(d) for d in datasets], int(info.metadata.get("imatrix.chunk_count") or 0)
    )
