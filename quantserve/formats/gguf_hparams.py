"""Sanity checks on a GGUF's architecture hyper-parameters, for values that make llama.cpp abort, not fail.

Found by fuzzing the real model: `{arch}.block_count` of 0 or above llama.cpp's LLAMA_MAX_LAYERS trips a
GGML_ASSERT (SIGABRT) during loading, where other bad values get a clean load error from llama.cpp itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from quantserve.errors import ModelFileError

LLAMA_MAX_LAYERS = 512  # llama.cpp src/llama-hparams.h
LLAMA_MAX_EXPERTS = 512  # llama.cpp src/llama-hparams.h
_POSITIVE = ("embedding_length", "attention.head_count", "attention.head_count_kv", "context_length")
_BLK = re.compile(r"^blk\.(\d+)\.")


def check_hparams(name: str, metadata: Mapping[str, Any], tensor_names: Sequence[str]) -> None:
    """Raise ModelFileError for hyper-parameters that llama.cpp cannot survive.

    Args:
        name: the file, for the message.
        metadata: the GGUF key/value pairs.
        tensor_names: every tensor name in the file.
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return

    def bad(key: str, value: Any, why: str) -> ModelFileError:
        return ModelFileError(
            f"{name}: metadata {key} = {value!r} {why}; the file is corrupt or was written by a "
            "broken converter — convert or download it again"
        )

    n_layer = metadata.get(f"{arch}.block_count")
    if n_layer is not None:
        if not isinstance(n_layer, int) or not 1 <= n_layer <= LLAMA_MAX_LAYERS:
            raise bad(f"{arch}.block_count", n_layer, f"is outside 1..{LLAMA_MAX_LAYERS}")
        blocks = {int(m.group(1)) for t in tensor_names if (m := _BLK.match(t))}
        if blocks and max(blocks) >= n_layer:
            raise bad(f"{arch}.block_count", n_layer, f"but the file has tensors for block {max(blocks)}")
    for key in _POSITIVE:
        value = metadata.get(f"{arch}.{key}")
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise bad(f"{arch}.{key}", value, "must be at least 1")
    n_expert = metadata.get(f"{arch}.expert_count")
    if isinstance(n_expert, int) and not 0 <= n_expert <= LLAMA_MAX_EXPERTS:
        raise bad(f"{arch}.expert_count", n_expert, f"is outside 0..{LLAMA_MAX_EXPERTS}")
    n_used = metadata.get(f"{arch}.expert_used_count")
    if isinstance(n_used, int) and isinstance(n_expert, int) and n_used > n_expert:
        raise bad(f"{arch}.expert_used_count", n_used, f"exceeds expert_count {n_expert}")
