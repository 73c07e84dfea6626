"""Builders for tiny checkpoint fixtures: GGUF (valid and hand-crafted bytes), safetensors, HF quant layouts."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import save_file

K, N = 128, 64  # every quantized linear here is [N=64 out, K=128 in]
RNG = np.random.default_rng(0)


# ---- GGUF --------------------------------------------------------------------------------------


def write_gguf(
    path: Path, *, split_max_tensors: int = 0, general_type: str | None = None, arch: str = "llama"
) -> Path:
    """A 4-tensor llama-shaped GGUF (F32 embeddings/norm, Q4_1 and Q8_0 matrices); returns the first file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_context_length(256)
    w.add_file_type(3)  # MOSTLY_Q4_1
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_token_list(["<s>", "</s>", "a", "b"])
    if general_type:
        w.add_type(general_type)
    w.add_tensor("token_embd.weight", RNG.standard_normal((4, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    q41 = quantize(RNG.standard_normal((64, 64), dtype=np.float32), GGMLQuantizationType.Q4_1)
    w.add_tensor("blk.0.attn_q.weight", q41, raw_dtype=GGMLQuantizationType.Q4_1)
    q80 = quantize(RNG.standard_normal((32, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_down.weight", q80, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return path.with_name(f"{path.stem}-00001-of-{-(-4 // split_max_tensors):05d}.gguf")
    return path


def gguf_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf_kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One KV pair; `payload` is the already-encoded value (after the type)."""
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def gguf_tensor_info(name: str | bytes, shape: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return gguf_string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, ggml_type, offset)


def gguf_bytes(
    kvs: list[bytes],
    infos: list[bytes],
    data: bytes = b"",
    *,
    version: int = 3,
    alignment: int = 32,
    n_tensors: int | None = None,
    n_kv: int | None = None,
) -> bytes:
    """Hand-assembled GGUF bytes, for files GGUFWriter refuses to write."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)  # fmt: skip
    body = head + b"".join(kvs) + b"".join(infos)
    body += b"\0" * (-len(body) % alignment)
    return body + data


def arch_kv() -> bytes:
    return gguf_kv("general.architecture", 8, gguf_string("llama"))


# ---- safetensors -------------------------------------------------------------------------------


def write_raw_safetensors(
    path: Path, entries: dict[str, tuple[str, list[int], bytes]], metadata=None
) -> Path:
    """Write a safetensors file by hand (numpy has no bfloat16); entries: name -> (dtype, shape, data)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    blobs, pos = [], 0
    for name, (dtype, shape, data) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def dense_tensors(dtype=np.float16) -> dict[str, np.ndarray]:
    return {
        "model.embed_tokens.weight": RNG.standard_normal((32, K)).astype(dtype),
        "model.layers.0.input_layernorm.weight": np.ones(K, dtype=dtype),
        "model.layers.0.self_attn.q_proj.weight": RNG.standard_normal((N, K)).astype(dtype),
        "model.norm.weight": np.ones(K, dtype=dtype),
        "lm_head.weight": RNG.standard_normal((32, K)).astype(dtype),
    }


def _i32(*shape: int) -> np.ndarray:
    return RNG.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int64).astype(np.int32)


def gptq_layer(prefix: str, bits: int = 4, group: int = 32) -> dict[str, np.ndarray]:
    g = K // group if group > 0 else 1
    return {
        f"{prefix}.qweight": _i32(K * bits // 32, N),
        f"{prefix}.qzeros": np.full((g, N * bits // 32), 0x77777777, dtype=np.int32),
        f"{prefix}.scales": np.ones((g, N), dtype=np.float16),
        f"{prefix}.g_idx": (np.arange(K) // (group if group > 0 else K)).astype(np.int32),
    }


def awq_layer(prefix: str, group: int = 32) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.qweight": _i32(K, N // 8),
        f"{prefix}.qzeros": _i32(K // group, N // 8),
        f"{prefix}.scales": np.ones((K // group, N), dtype=np.float16),
    }


def marlin_layer(prefix: str, group: int = 128) -> dict[str, np.ndarray]:
    return {f"{prefix}.B": _i32(K // 16, 2 * N), f"{prefix}.s": np.ones((K // group, N), dtype=np.float16)}


def ct_layer(prefix: str, bits: int = 4, group: int = 32) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.weight_packed": _i32(N, K * bits // 32),
        f"{prefix}.weight_scale": np.ones((N, K // group), dtype=np.float16),
        f"{prefix}.weight_shape": np.array([N, K], dtype=np.int64),
    }


def quantized_model(layer: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Dense embeddings/norms/lm_head plus one quantized q_proj."""
    tensors = {k: v for k, v in dense_tensors().items() if "q_proj" not in k}
    return tensors | layer


Q_PROJ = "model.layers.0.self_attn.q_proj"


def write_hf(
    directory: Path,
    tensors: dict[str, np.ndarray],
    quantization_config: dict[str, Any] | None = None,
    *,
    extra_files: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """config.json (+ quantization_config) and model.safetensors; extra_files are written as JSON."""
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    config["max_position_embeddings"] = 2048
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    for name, value in (extra_files or {}).items():
        (directory / name).write_text(json.dumps(value))
    save_file(tensors, str(directory / "model.safetensors"), metadata=metadata)
    return directory


def write_sharded(directory: Path, tensors: dict[str, np.ndarray], n_shards: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        save_file(part, str(directory / shard))
        weight_map |= dict.fromkeys(part, shard)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory
