"""Sanity checks on a GGUF's architecture hyper-parameters, vocabulary and tensor types, for values that make
llama.cpp abort, not fail.

Found by fuzzing the real model (bench/gguf_fuzz.py, tests/fixtures/gguf_mutants.py): each of these trips a
GGML_ASSERT or an uncaught C++ exception (SIGABRT) during loading or at the first decode, where other bad values get
a clean load error from llama.cpp itself. What is left to llama.cpp (per-layer shapes against per-layer head
counts, norm weights in types a backend cannot multiply by) the server's probe contains
(quantserve.backends.llamacpp.probe).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gguf import GGMLQuantizationType as T

from quantserve.errors import ModelFileError

LLAMA_MAX_LAYERS = 512  # llama.cpp src/llama-hparams.h
LLAMA_MAX_EXPERTS = 512  # llama.cpp src/llama-hparams.h
_POSITIVE = ("embedding_length", "attention.head_count", "attention.head_count_kv", "context_length")
_BLK = re.compile(r"^blk\.(\d+)\.")
_EPSILONS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon")
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp src/llama-model.cpp's names
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)  # what a norm weight or a bias may be stored as


def _count(value: Any) -> int | None:
    """A scalar count, or the largest of a per-layer array of them (llama.cpp reads both)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return max(value)
    return None


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
    for key in _EPSILONS:
        eps = metadata.get(f"{arch}.{key}")
        if isinstance(eps, float) and not (math.isfinite(eps) and eps >= 0):
            raise bad(f"{arch}.{key}", eps, "must be a finite number >= 0")
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise bad(f"{arch}.rope.scaling.type", scaling, f"is none of {', '.join(ROPE_SCALING_TYPES)}")
    nextn = _count(metadata.get(f"{arch}.nextn_predict_layers"))
    if nextn is not None and n_layer is not None and not 0 <= nextn <= n_layer:
        raise bad(f"{arch}.nextn_predict_layers", nextn, f"is outside 0..block_count ({n_layer})")
    _check_experts(arch, metadata, bad)


def _check_experts(arch: str, metadata: Mapping[str, Any], bad) -> None:
    """llama-model.cpp's asserts on mixture-of-experts counts: used <= count, used >= 1 when there are experts,
    no expert groups without experts, and groups that divide the experts."""
    n_expert = _count(metadata.get(f"{arch}.expert_count")) or 0
    if arch in ("hunyuan-dense", "hunyuan_vl") and n_expert <= 1:
        return  # llama.cpp resets these dense models' expert counts to 0 before its checks
    if not 0 <= n_expert <= LLAMA_MAX_EXPERTS:
        raise bad(f"{arch}.expert_count", n_expert, f"is outside 0..{LLAMA_MAX_EXPERTS}")
    n_used = _count(metadata.get(f"{arch}.expert_used_count"))
    if n_used is not None and n_used > n_expert:
        raise bad(f"{arch}.expert_used_count", n_used, f"exceeds expert_count {n_expert}")
    groups = _count(metadata.get(f"{arch}.expert_group_count")) or 0
    if n_expert == 0:
        if groups:
            raise bad(f"{arch}.expert_group_count", groups, "is set but the model has no experts")
        return
    if n_used is None or n_used < 1:
        raise bad(f"{arch}.expert_used_count", n_used, f"must be at least 1 with expert_count {n_expert}")
    if groups >= n_expert:
        raise bad(f"{arch}.expert_group_count", groups, f"must be below expert_count {n_expert}")
    if groups > 1:
        used_groups = _count(metadata.get(f"{arch}.expert_group_used_count")) or 0
        if n_expert % groups or not 0 < used_groups < groups:
            raise bad(
                f"{arch}.expert_group_count", groups,
                f"must divide expert_count {n_expert}, with 0 < expert_group_used_count ({used_groups}) < it",
            )  # fmt: skip


def check_vocab(name: str, metadata: Mapping[str, Any]) -> None:
    """A SentencePiece ("llama") vocabulary must give every byte a token, <0xXX> or (below 0x80) the character
    itself: llama.cpp falls back to them for any character outside the vocabulary and aborts (an uncaught
    std::out_of_range) when one is missing, on a request rather than at load."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if metadata.get("tokenizer.ggml.model") != "llama" or not isinstance(tokens, list):
        return
    have = set(tokens)
    missing = [b for b in range(256) if f"<0x{b:02X}>" not in have and not (b < 0x80 and chr(b) in have)]
    if missing:
        raise ModelFileError(
            f"{name}: this SentencePiece vocabulary (tokenizer.ggml.model 'llama') has no token for {len(missing)} "
            f"of the 256 bytes (first <0x{missing[0]:02X}>), so llama.cpp would abort on the first request holding "
            "a character outside it; quantserve refuses it. Convert the model again from its original tokenizer"
        )


def check_tensor_types(name: str, tensors: Sequence[Any]) -> None:
    """1-D tensors (norm weights, biases) in a float type: llama.cpp's tools write them as F32 and quantize only
    matrices, and llama.cpp loads an integer or block-quantized one only to abort at the first decode, when no
    kernel multiplies by it. (F16 and BF16 pass: some backends take them; where the CPU backend does not, the
    server's probe contains the abort.)"""
    for t in tensors:
        if len(t.shape) == 1 and t.ggml_type not in _FLOAT_TYPES:
            raise ModelFileError(
                f"{name}: tensor '{t.name}' is 1-D but {t.type_name}; llama.cpp cannot compute with that (it would "
                "abort at the first request): norm weights and biases are F32. The file is corrupt or was written "
                "by a broken converter — convert or download it again"
            )
