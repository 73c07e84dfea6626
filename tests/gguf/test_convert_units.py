"""Converter building blocks: q/k permutation, float bit tricks, quant-type rules, quantizer fidelity, writers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors import safe_open

from quantserve.errors import ConfigError
from quantserve.formats.safetensors_out import PlannedTensor, SafetensorsWriter
from quantserve.formats.staging import staged_output
from quantserve.gguf.native_quant import ggml_quantize
from quantserve.gguf.pretokenizers import PRE_TOKENIZER_HASHES, PRE_TOKENIZERS
from quantserve.gguf.quant_types import QUANTS, direct_tensor_type, parse_quant
from quantserve.gguf.tensor_math import (
    bf16_to_f32,
    f32_to_bf16,
    qk_gguf_rows_for_hf,
    qk_hf_rows_for_gguf,
)

RNG = np.random.default_rng(0)


def test_qk_permutation_matches_llama_cpp_and_inverts():
    n_head, d, k = 3, 8, 5
    hf = RNG.standard_normal((n_head * d, k)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently
    ref = hf.reshape(n_head, 2, d // 2, k).swapaxes(1, 2).reshape(hf.shape)
    gguf_w = hf[qk_hf_rows_for_gguf(n_head * d, n_head)]
    np.testing.assert_array_equal(gguf_w, ref)
    np.testing.assert_array_equal(gguf_w[qk_gguf_rows_for_hf(n_head * d, n_head)], hf)
    # docs/gguf.md, "Q/K permutation", index form: HF row h·D + r <- GGUF row h·D + 2·(r mod D/2) + r // (D/2)
    for h in range(n_head):
        for r in range(d):
            np.testing.assert_array_equal(hf[h * d + r], gguf_w[h * d + 2 * (r % (d // 2)) + r // (d // 2)])
    with pytest.raises(ValueError):
        qk_gguf_rows_for_hf(10, 3)


def test_bf16_bits_match_torch():
    x = np.concatenate(
        [RNG.standard_normal(10_000).astype(np.float32) * 1e3, [0.0, -0.0, np.inf, -np.inf, 1e-40]]
    )
    x = x.astype(np.float32)
    ours = f32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(bf16_to_f32(ours), torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_gguf_py_quantizers_are_bit_exact_with_ggml(qtype):
    """Our direct writer uses gguf.quants for these types; ggml's reference quantizer gives the same bytes."""
    x = (RNG.standard_normal((64, 512)) * RNG.uniform(0.01, 3, (64, 1))).astype(np.float32)
    np.testing.assert_array_equal(quants.quantize(x, qtype), ggml_quantize(x, qtype))


def test_ggml_q6_k_round_trips_through_gguf_dequantize():
    x = RNG.standard_normal((8, 512)).astype(np.float32)
    back = quants.dequantize(ggml_quantize(x, T.Q6_K), T.Q6_K)
    assert np.abs(back - x).mean() / np.abs(x).mean() < 0.02


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("Q4_K_M", "q4_k_m"),
        ("q4k", "q4_k_m"),
        ("q5-k-s", "q5_k_s"),
        ("FP16", "f16"),
        ("q8_0", "q8_0"),
        ("Q6_K", "q6_k"),
    ],
)
def test_parse_quant(text, name):
    assert parse_quant(text).name == name


def test_parse_quant_error_lists_choices():
    with pytest.raises(ConfigError, match="q4_k_m.*q4k = q4_k_m"):
        parse_quant("q7_x")


def test_direct_tensor_types_follow_llama_cpp():
    q41, q80 = QUANTS["q4_1"], QUANTS["q8_0"]
    assert direct_tensor_type("blk.0.attn_norm.weight", (576,), q41, True) == T.F32
    assert direct_tensor_type("blk.0.attn_q.bias", (576,), q41, True) == T.F32
    assert direct_tensor_type("blk.0.attn_q.weight", (576, 576), q41, True) == T.Q4_1
    # output (or the tied embedding): Q6_K when rows allow 256-blocks, else Q8_0 (llama-quantize)
    assert direct_tensor_type("token_embd.weight", (576, 49152), q41, True) == T.Q8_0
    assert direct_tensor_type("token_embd.weight", (512, 100), q41, True) == T.Q6_K
    assert direct_tensor_type("token_embd.weight", (512, 100), q41, False) == T.Q4_1
    assert direct_tensor_type("output.weight", (512, 100), q41, False) == T.Q6_K
    assert direct_tensor_type("output.weight", (512, 100), q80, False) == T.Q8_0
    assert direct_tensor_type("blk.0.ffn_down.weight", (100, 64), q41, True) == T.F16  # 100 % 32 != 0


def test_pretokenizer_hash_table_names_are_buildable():
    assert set(PRE_TOKENIZER_HASHES.values()) <= set(PRE_TOKENIZERS)


def test_safetensors_writer_shards_and_streams(tmp_path):
    tensors = {f"t{i}": RNG.standard_normal((i + 2, 3)).astype(np.float32) for i in range(5)}
    plan = [PlannedTensor(n, "F32", a.shape) for n, a in tensors.items()]
    with SafetensorsWriter(tmp_path, plan, shard_bytes=60) as w:
        for n, a in tensors.items():
            w.write(n, [a[:1], a[1:]])  # chunks are concatenated
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for name, a in tensors.items():
        with safe_open(tmp_path / index["weight_map"][name], framework="numpy") as f:
            np.testing.assert_array_equal(f.get_tensor(name), a)


def test_safetensors_writer_rejects_wrong_order_and_size(tmp_path):
    plan = [PlannedTensor("a", "F16", (2,)), PlannedTensor("b", "F16", (2,))]
    with pytest.raises(ValueError, match="expected tensor 'a'"), SafetensorsWriter(tmp_path, plan) as w:
        w.write("b", [np.zeros(2, np.float16)])
    with pytest.raises(ValueError, match="wrote 2 bytes"), SafetensorsWriter(tmp_path, plan) as w:
        w.write("a", [np.zeros(1, np.float16)])


def test_staged_output_leaves_nothing_on_failure(tmp_path):
    dst = tmp_path / "new" / "out.gguf"
    with pytest.raises(RuntimeError), staged_output(dst, directory=False, force=False) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert not (tmp_path / "new").exists()
    with staged_output(dst, directory=False, force=False) as tmp:
        tmp.write_bytes(b"done")
    assert dst.read_bytes() == b"done" and list(dst.parent.iterdir()) == [dst]
    with pytest.raises(ConfigError, match="--force"), staged_output(dst, directory=False, force=False):
        pass
    with staged_output(dst, directory=False, force=True) as tmp:
        tmp.write_bytes(b"again")
    assert dst.read_bytes() == b"again"
