"""GGUF files that pass quantserve's validator but make llama.cpp abort: rewritten copies of a real model's header.

`edit_metadata` rewrites a GGUF's key/value pairs (the tensor table and data are copied unchanged, the data
re-aligned); `write_aborting_gguf` uses it to write one such file, for the probe's tests and the router's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantserve.formats import read_gguf_info

U32, I32, F32, STRING, ARRAY = 4, 5, 6, 8, 9  # GGUF value types (ggml gguf.h)
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

# A key -> (GGUF value type, encoded value) table, in file order.
KVs = dict[str, tuple[int, bytes]]


def gguf_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf_u32(v: int) -> tuple[int, bytes]:
    return U32, struct.pack("<I", v)


def gguf_str(s: str) -> tuple[int, bytes]:
    return STRING, gguf_string(s)


def gguf_u32_array(values: list[int]) -> tuple[int, bytes]:
    return ARRAY, struct.pack("<IQ", U32, len(values)) + struct.pack(f"<{len(values)}I", *values)


def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    if vtype in _SCALAR_SIZE:
        return pos + _SCALAR_SIZE[vtype]
    if vtype == STRING:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    etype, count = struct.unpack_from("<IQ", data, pos)  # an array
    pos += 12
    if etype in _SCALAR_SIZE:
        return pos + count * _SCALAR_SIZE[etype]
    for _ in range(count):
        pos = _skip_value(data, pos, etype)
    return pos


def edit_metadata(
    src: Path, dst: Path, edit: Callable[[KVs], None] | None = None, retype: dict[str, int] | None = None
) -> None:
    """Copy the GGUF `src` to `dst` with its key/value pairs changed in place by `edit`, and the ggml types of the
    tensors named in `retype` set (type numbers as in ggml.h; the caller keeps the table's offsets valid).

    The file must be valid (read_gguf_info accepts it); tensor data is copied as it is, moved to the next
    multiple of the alignment after the new header."""
    info = read_gguf_info(src)
    data = src.read_bytes()
    _, _, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    pos, kvs = 24, {}
    for _ in range(n_kv):
        n = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8 : pos + 8 + n].decode()
        vtype = struct.unpack_from("<I", data, pos + 8 + n)[0]
        start = pos + 12 + n
        pos = _skip_value(data, start, vtype)
        kvs[key] = (vtype, data[start:pos])
    tensor_infos = bytearray()
    for _ in range(n_tensors):
        start = pos
        name = data[pos + 8 : pos + 8 + struct.unpack_from("<Q", data, pos)[0]].decode()
        pos += 8 + len(name.encode())
        pos += 4 + 8 * struct.unpack_from("<I", data, pos)[0]  # n_dims, ne[]
        tensor_infos += data[start:pos]
        gtype = (retype or {}).get(name, struct.unpack_from("<I", data, pos)[0])
        tensor_infos += struct.pack("<I", gtype) + data[pos + 4 : pos + 12]  # type, data offset
        pos += 12
    if edit is not None:
        edit(kvs)
    head = struct.pack("<4sIQQ", b"GGUF", info.version, n_tensors, len(kvs))
    head += b"".join(gguf_string(k) + struct.pack("<I", t) + v for k, (t, v) in kvs.items()) + tensor_infos
    head += b"\0" * (-len(head) % info.alignment)
    with dst.open("wb") as f:
        f.write(head)
        f.write(memoryview(data)[info.data_offset :])


def _arch_key(kvs: KVs, name: str) -> str:
    _, raw = kvs["general.architecture"]
    return f"{raw[8:].decode()}.{name}"


def _set(name: str, value: tuple[int, bytes], *, arch: bool = True) -> Callable[[KVs], None]:
    def edit(kvs: KVs) -> None:
        kvs[_arch_key(kvs, name) if arch else name] = value

    return edit


def _per_layer_head_count_kv(kvs: KVs) -> None:
    n_layer = struct.unpack("<I", kvs[_arch_key(kvs, "block_count")][1])[0]
    n_kv = struct.unpack("<I", kvs[_arch_key(kvs, "attention.head_count_kv")][1])[0]
    kvs[_arch_key(kvs, "attention.head_count_kv")] = gguf_u32_array([n_kv] * (n_layer - 1) + [1])


def _experts_without_use(kvs: KVs) -> None:
    _set("expert_count", gguf_u32(4))(kvs)
    _set("expert_used_count", gguf_u32(0))(kvs)


@dataclass(frozen=True)
class Mutant:
    description: str  # the change, then where and when llama.cpp aborts
    edit: Callable[[KVs], None] | None = None
    retype: dict[str, int] | None = None  # tensor name -> ggml type


# Each made llama.cpp abort the process (SIGABRT) when found, and passed read_gguf_info then. The validator now
# refuses all of them but PASSING (quantserve.formats.gguf_hparams); those two the server's probe contains.
ABORTING = (
    Mutant(
        "llama.attention.layer_norm_rms_epsilon = -1.0; at the first decode: ggml-cpu ops.cpp "
        "GGML_ASSERT(eps >= 0.0f)",
        _set("attention.layer_norm_rms_epsilon", (F32, struct.pack("<f", -1.0))),
    ),
    Mutant(
        "llama.rope.scaling.type = 'bogus'; at load: llama-model.cpp "
        "GGML_ASSERT(hparams.rope_scaling_type_train != LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED)",
        _set("rope.scaling.type", gguf_str("bogus")),
    ),
    Mutant(
        "llama.expert_used_count = 1 without expert_count; at load: llama-model.cpp "
        "GGML_ASSERT(n_expert_used_max <= hparams.n_expert)",
        _set("expert_used_count", gguf_u32(1)),
    ),
    Mutant(
        "llama.expert_count = 4 with expert_used_count = 0; at load: llama-model.cpp "
        "GGML_ASSERT(n_expert_used_max > 0)",
        _experts_without_use,
    ),
    Mutant(
        "llama.expert_group_count = 1 without experts; at load: llama-model.cpp "
        "GGML_ASSERT(hparams.n_expert_groups == 0)",
        _set("expert_group_count", gguf_u32(1)),
    ),
    Mutant(
        "llama.nextn_predict_layers = 31 > block_count 30; at load: llama-model.cpp "
        "GGML_ASSERT(hparams.n_layer_nextn <= hparams.n_layer_all)",
        _set("nextn_predict_layers", gguf_u32(31)),
    ),
    Mutant(
        "llama.attention.head_count_kv a per-layer array, the last layer 1 where its attn_k holds 3 heads; "
        "at context creation (graph reserve): ggml.c GGML_ASSERT(a->ne[0] == b->ne[0])",
        _per_layer_head_count_kv,
    ),
    Mutant(
        "tokenizer.ggml.model = 'llama' (SentencePiece) over a GPT-2 vocabulary, which has no <0xXX> byte "
        "tokens; at the first tokenization of a character outside the vocabulary: std::out_of_range from "
        "unordered_map::at, uncaught",
        _set("tokenizer.ggml.model", gguf_str("llama"), arch=False),
    ),
    Mutant(
        "blk.0.attn_norm.weight stored as I32 instead of F32 (the same bytes); at the first decode: ggml-cpu "
        "binary-ops.cpp binary_op: unsupported types: dst: f32, src0: f32, src1: i32",
        retype={"blk.0.attn_norm.weight": 26},  # GGML_TYPE_I32
    ),
    Mutant(
        "output_norm.weight, the file's last tensor, stored as F16 instead of F32 (its data shrinks to fit); at "
        "the first decode: ggml-cpu binary-ops.cpp binary_op: unsupported types: dst: f32, src0: f32, src1: f16",
        retype={"output_norm.weight": 1},  # GGML_TYPE_F16
    ),
)


# Still past the validator: per-layer head counts against each layer's tensor shapes (llama.cpp checks layer 0's),
# and a norm weight in a type that one backend multiplies by and another aborts on.
PASSING = (ABORTING[6], ABORTING[9])


def write_mutant(src: Path, dst: Path, mutant: Mutant) -> None:
    edit_metadata(src, dst, mutant.edit, mutant.retype)


def write_aborting_gguf(src: Path, dst: Path) -> str:
    """Write a copy of the GGUF `src` (a llama-architecture model) to `dst` that passes read_gguf_info but makes
    llama.cpp abort, at its first decode (so only a probe that evaluates a token finds it).

    Returns:
        A one-line description of the mutation.
    """
    write_mutant(src, dst, PASSING[1])
    return PASSING[1].description
