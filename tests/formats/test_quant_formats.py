"""GPTQ / AWQ / compressed-tensors / Marlin: write -> detect -> read round trips, checked against independent numpy
decoders written from the docs, the tensor/config contract vLLM's loaders expect, hand-built files, errors.

Section names refer to docs/quantized-checkpoints.md unless docs/marlin.md is named.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from quantserve.converters.hf_quant import WriteOptions, write_quantized
from quantserve.errors import ConfigError, ModelFileError, UnsupportedFormatError
from quantserve.formats import detect, read_safetensors_header
from quantserve.formats.quant_read import open_quantized
from quantserve.formats.schemes import schemes
from quantserve.formats.spec import ModelSpec
from quantserve.kernels.qweight import QuantizedWeight

K, N = 128, 64
Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"
BASE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True}


# ---- builders ----------------------------------------------------------------------------------


def qw(bits=4, group=32, sym=True, act=False, k=K, n=N, seed=0, dtype=torch.float16) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    n_groups = 1 if group == -1 else k // group
    q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n_groups, n, generator=g) * 0.05 + 0.001).to(dtype)
    zeros = None if sym else torch.randint(0, 1 << bits, (n_groups, n), generator=g, dtype=torch.uint8)
    g_idx = (torch.randperm(k, generator=g) % n_groups).to(torch.int32) if act else None
    return QuantizedWeight(q, scales, zeros, bits, group, g_idx)


def tokenizer_dir(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (src / name).write_text(json.dumps({"name": name}))
    return src


def write(
    tmp: Path, fmt: str, weights: dict[str, QuantizedWeight], *, bias=None, config=None, **opts
) -> Path:
    dense = [
        ("model.embed_tokens.weight", torch.randn(32, K).half()),
        ("model.norm.weight", torch.ones(K).half()),
        ("lm_head.weight", torch.randn(32, K).half()),  # skipped: tied
    ]
    layers = [(p, w, bias) for p, w in weights.items()]
    return write_quantized(
        tmp / f"out-{fmt}",
        fmt,
        layers,
        dense,
        config or BASE_CONFIG,
        tokenizer_dir(tmp),
        options=WriteOptions(**opts),
    )


def raw(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(f)
    return out


def u32(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


# ---- independent reference decoders (numpy, from docs/) ------------------------------------------


def np_unpack(words: np.ndarray, bits: int, axis: int, count: int) -> np.ndarray:
    """Value j along `axis` starts at global bit bits*j, LSB-first, and may straddle two words
    ("GPTQ bit packing", "compressed-tensors packing")."""
    w = np.moveaxis(words.astype(np.uint64), axis, 0)
    w = np.concatenate([w, np.zeros_like(w[:1])])
    j = np.arange(count)
    word, off = (bits * j) // 32, ((bits * j) % 32).astype(np.uint64)
    both = w[word] | (w[word + 1] << np.uint64(32))
    vals = (both >> off[:, None]) & np.uint64((1 << bits) - 1)
    return np.moveaxis(vals.astype(np.int64), 0, axis)


def gather(s: np.ndarray, z: np.ndarray, g: np.ndarray, q: np.ndarray) -> np.ndarray:
    return s[g] * (q - z[g])


def ref_gptq(t: dict, p: str, qc: dict) -> np.ndarray:
    b, g_idx, s = qc["bits"], t[f"{p}.g_idx"].numpy(), t[f"{p}.scales"].float().numpy()
    q = np_unpack(u32(t[f"{p}.qweight"]), b, 0, len(g_idx))
    qz = u32(t[f"{p}.qzeros"])
    if qc["checkpoint_format"] == "gptq_v2":
        z = np_unpack(qz, b, 1, s.shape[1])
    else:  # v1: +1 per slot ("GPTQ zero points"); the writer only uses v1 for these symmetric cases
        z = (np_unpack(qz, b, 1, s.shape[1]) + 1) & ((1 << b) - 1)
    return gather(s, z, g_idx, q)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def np_awq(words: np.ndarray) -> np.ndarray:
    out = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
    for c in range(words.shape[1]):
        for p in range(8):  # slot p of word c holds logical column 8c + order[p] ("AWQ GEMM layout")
            out[:, 8 * c + AWQ_ORDER[p]] = (words[:, c].astype(np.int64) >> (4 * p)) & 15
    return out


def ref_awq(t: dict, p: str, qc: dict) -> np.ndarray:
    q, z = np_awq(u32(t[f"{p}.qweight"])), np_awq(u32(t[f"{p}.qzeros"]))
    return gather(t[f"{p}.scales"].float().numpy(), z, np.arange(q.shape[0]) // qc["group_size"], q)


def ref_ct(t: dict, p: str, qc: dict) -> np.ndarray:
    w = qc["config_groups"]["group_0"]["weights"]
    b = w["num_bits"]
    n, k = t[f"{p}.weight_shape"].tolist()
    q = np_unpack(u32(t[f"{p}.weight_packed"]), b, 1, k)  # [N, K]
    s = t[f"{p}.weight_scale"].float().numpy()  # [N, groups]
    zp = np_unpack(u32(t[f"{p}.weight_zero_point"]), b, 0, n) if not w["symmetric"] else 1 << (b - 1)
    gi = (
        t[f"{p}.weight_g_idx"].numpy() if f"{p}.weight_g_idx" in t else np.arange(k) // (w["group_size"] or k)
    )
    zp = np.broadcast_to(zp, s.shape)
    return (s[:, gi] * (q - zp[:, gi])).T  # "compressed-tensors dequantization", back to [K, N]


def unperm(x: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Undo x'[c + t] = x[c + perm[t]] on consecutive chunks of len(perm) (docs/marlin.md, "Scale
    permutations")."""
    flat = x.reshape(-1, perm.size)
    out = np.empty_like(flat)
    out[:, perm] = flat
    return out.reshape(x.shape)


SCALE_PERM = np.arange(64) // 8 + 8 * (np.arange(64) % 8)
SCALE_PERM_SINGLE = 2 * (np.arange(32) // 8) + np.array([0, 1, 8, 9, 16, 17, 24, 25])[np.arange(32) % 8]


def ref_marlin(t: dict, p: str, qc: dict) -> np.ndarray:
    """4-bit "Closed form" of docs/marlin.md (AutoGPTQ / candle-vllm B and s), plus its "Act-order" perm and
    sorted g_idx and its "Zero points" zp."""
    b, s = u32(t[f"{p}.B"]).astype(np.int64), t[f"{p}.s"].float().numpy()
    k, n = 16 * b.shape[0], s.shape[1]
    q = np.zeros((k, n), dtype=np.int64)
    off = [0, 1, 8, 9]
    for tt in range(b.shape[0]):
        for j in range(b.shape[1]):
            lane = (j % 128) // 4
            r0, c0 = 16 * tt + 2 * (lane % 4), 64 * (j // 128) + 16 * (j % 4) + lane // 4
            for slot, m in enumerate(AWQ_ORDER):  # slot p holds v[[0,2,4,6,1,3,5,7][p]]
                q[r0 + off[m % 4], c0 + 8 * (m // 4)] = (b[tt, j] >> (4 * slot)) & 15
    grouped = qc["group_size"] != -1 and qc["group_size"] < k
    s = unperm(s, SCALE_PERM if grouped else SCALE_PERM_SINGLE)
    g = np.arange(k) // (k if qc["group_size"] == -1 else qc["group_size"])
    if f"{p}.perm" in t:  # packed row r is natural row perm[r]; g_idx is stored sorted
        perm = t[f"{p}.perm"].numpy()
        natural = np.empty_like(q)
        natural[perm] = q
        q, g = natural, np.empty_like(g)
        g[perm] = t[f"{p}.g_idx"].numpy()
    z = np.full(s.shape, 8)
    # packed along N, interleaved within 8, scale_perm on chunks of 64 (docs/marlin.md, "Zero points")
    if f"{p}.zp" in t:
        z = unperm(unperm(np_unpack(u32(t[f"{p}.zp"]), 4, 1, n), np.array(AWQ_ORDER)), SCALE_PERM)
    return gather(s, z, g, q)


REFERENCE = {"gptq": ref_gptq, "awq": ref_awq, "compressed-tensors": ref_ct, "marlin": ref_marlin}

# ---- round trips ------------------------------------------------------------------------------------

CASES = [  # id, format, qw kwargs, WriteOptions kwargs
    ("gptq-4bit-sym-v1", "gptq", {}, {}),
    ("gptq-4bit-asym-v2", "gptq", {"sym": False}, {}),
    ("gptq-4bit-act", "gptq", {"act": True}, {}),
    ("gptq-2bit-sym", "gptq", {"bits": 2}, {}),
    ("gptq-3bit-asym-act", "gptq", {"bits": 3, "sym": False, "act": True}, {}),
    ("gptq-8bit-channel", "gptq", {"bits": 8, "group": -1}, {}),
    ("gptq-bf16-scales", "gptq", {"dtype": torch.bfloat16}, {"scale_dtype": torch.bfloat16}),
    ("awq-asym", "awq", {"sym": False}, {}),
    ("awq-sym-as-zero-8", "awq", {"group": 64}, {}),
    ("ct-4bit-sym", "compressed-tensors", {}, {}),
    ("ct-4bit-asym-act-bf16", "compressed-tensors", {"sym": False, "act": True, "dtype": torch.bfloat16}, {}),
    ("ct-8bit-channel-asym", "compressed-tensors", {"bits": 8, "group": -1, "sym": False}, {}),
    ("ct-2bit", "compressed-tensors", {"bits": 2, "sym": False}, {}),
    ("ct-3bit-dense-0.18", "compressed-tensors", {"bits": 3}, {"ct_version": "0.18.0"}),
    ("marlin-4bit-128", "marlin", {"group": 128}, {}),
    ("marlin-4bit-channel", "marlin", {"group": -1}, {}),
    ("marlin-4bit-asym-act", "marlin", {"group": 128, "sym": False, "act": True, "k": 256}, {}),
]


def assert_same(got: QuantizedWeight, want: QuantizedWeight) -> None:
    want = want.with_trivial_g_idx_dropped()
    if want.zeros is not None and bool((want.zeros == 1 << (want.bits - 1)).all()):
        want = QuantizedWeight(want.qweight, want.scales, None, want.bits, want.group_size, want.g_idx)
    assert (got.bits, got.group_size) == (want.bits, want.group_size)
    assert torch.equal(got.qweight, want.qweight)
    assert got.scales.dtype == want.scales.dtype and torch.equal(got.scales, want.scales)
    for a, b in ((got.zeros, want.zeros), (got.g_idx, want.g_idx)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize(("fmt", "kw", "opts"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_round_trip_is_bit_exact_and_matches_the_reference_formula(tmp_path, fmt, kw, opts):
    weights = {Q: qw(**kw), DOWN: qw(seed=1, **kw)}
    bias = torch.randn(N).to(kw.get("dtype", torch.float16))
    d = write(tmp_path, fmt, weights, bias=bias, **opts)
    spec = detect(d)
    assert spec.format == fmt
    assert (spec.quant.get("bits") or spec.quant.get("num_bits")) == kw.get("bits", 4)
    t = raw(d)
    with open_quantized(d) as ck:
        assert ck.linear_prefixes() == sorted(weights)
        assert ck.dense_names() == ["model.embed_tokens.weight", "model.norm.weight"]  # lm_head tied
        for p, w in weights.items():
            got = ck.read_linear(p)
            assert_same(got, w)
            ref = REFERENCE[fmt](t, p, spec.config["quantization_config"])
            np.testing.assert_array_equal(got.dequantize().numpy(), ref.astype(np.float32))
            np.testing.assert_array_equal(got.dequantize().numpy(), w.dequantize().numpy())
            assert torch.equal(ck.read_bias(p).float(), bias.float())
        assert torch.equal(ck.read_dense("model.norm.weight"), torch.ones(K).half())


# Writer outputs outside the common cases, which detect() once rejected: read them with a spec built by hand, and
# detect them.
DETECT_GAPS = [
    ("ct-3bit-word-packed", "compressed-tensors", {"bits": 3}, "word packing (compressed-tensors < 0.18)"),
    ("marlin-group-64", "marlin", {"group": 64}, "vLLM's Marlin takes group_size 64"),
    ("marlin-8bit", "marlin", {"bits": 8, "group": 128}, "B = [K/16, 4N] for 8-bit"),
]


@pytest.mark.parametrize(("fmt", "kw", "gap"), [c[1:] for c in DETECT_GAPS], ids=[c[0] for c in DETECT_GAPS])
def test_reader_reads_what_detect_rejects(tmp_path, fmt, kw, gap):
    weights = {Q: qw(**kw), DOWN: qw(seed=1, **kw)}
    d = write(tmp_path, fmt, weights)
    config = json.loads((d / "config.json").read_text())
    qc = config["quantization_config"]
    scheme = schemes()[fmt].parse(qc, "test")  # the config alone, without detect()'s check of the tensors
    spec = ModelSpec(fmt, d, (d / "model.safetensors",), config, scheme.describe(), "llama", scheme)
    with open_quantized(spec) as ck:
        for p, w in weights.items():
            assert_same(ck.read_linear(p), w)
    if fmt == "compressed-tensors":
        # and 3-bit word packing is 10 values per word, 2 bits unused ("compressed-tensors packing")
        np.testing.assert_array_equal(
            ck.read_linear(Q).dequantize().numpy(),
            ref_ct_word(raw(d), Q, scheme.bits).astype(np.float32),
        )


def ref_ct_word(t: dict, p: str, b: int) -> np.ndarray:
    words = u32(t[f"{p}.weight_packed"]).astype(np.int64)
    pf = 32 // b
    q = np.stack([(words[:, i // pf] >> (b * (i % pf))) & ((1 << b) - 1) for i in range(K)], axis=1)
    s = t[f"{p}.weight_scale"].float().numpy()
    return (s[:, np.arange(K) // 32] * (q - (1 << (b - 1)))).T


@pytest.mark.parametrize(("fmt", "kw", "gap"), [c[1:] for c in DETECT_GAPS], ids=[c[0] for c in DETECT_GAPS])
def test_detect_classifies_every_written_dir(tmp_path, fmt, kw, gap):
    assert detect(write(tmp_path, fmt, {Q: qw(**kw)})).format == fmt


# ---- what vLLM / transformers / candle-vllm load ("GPTQ", "AWQ", "Marlin", "compressed-tensors") ------

G = 32
INTEROP = [  # format, qw kwargs, {suffix: (dtype, shape)}, required config keys
    (
        "gptq",
        {},
        {"qweight": ("I32", [K // 8, N]), "qzeros": ("I32", [K // G, N // 8]), "scales": ("F16", [K // G, N]),
         "g_idx": ("I32", [K])},
        {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq", "lm_head": False},
    ),
    (
        "gptq",
        {"bits": 8, "sym": False, "act": True},
        {"qweight": ("I32", [K // 4, N]), "qzeros": ("I32", [K // G, N // 4]), "scales": ("F16", [K // G, N]),
         "g_idx": ("I32", [K])},
        {"quant_method": "gptq", "bits": 8, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"},
    ),
    (
        "awq",
        {"sym": False},
        {"qweight": ("I32", [K, N // 8]), "qzeros": ("I32", [K // G, N // 8]), "scales": ("F16", [K // G, N])},
        {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": None},
    ),
    (
        "compressed-tensors",
        {"sym": False, "act": True, "dtype": torch.bfloat16},
        {"weight_packed": ("I32", [N, K // 8]), "weight_scale": ("BF16", [N, K // G]),
         "weight_zero_point": ("I32", [N // 8, K // G]), "weight_g_idx": ("I32", [K]),
         "weight_shape": ("I64", [2])},
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"], "version": "0.12.2"},
    ),
    (
        "compressed-tensors",
        {"group": -1},
        {"weight_packed": ("I32", [N, K // 8]), "weight_scale": ("F16", [N, 1]), "weight_shape": ("I64", [2])},
        {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    ),
    (
        "marlin",
        {"group": 128},
        {"B": ("I32", [K // 16, 2 * N]), "s": ("F16", [1, N])},
        {"quant_method": "gptq", "checkpoint_format": "marlin", "bits": 4, "group_size": 128, "sym": True,
         "desc_act": False},
    ),
]  # fmt: skip

CT_WEIGHTS = {
    0: {
        "num_bits": 4,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": G,
        "actorder": "group",
    },
    1: {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "group_size": None,
        "actorder": None,
    },
}


@pytest.mark.parametrize(
    ("fmt", "kw", "tensors", "keys"), INTEROP, ids=[f"{r[0]}-{i}" for i, r in enumerate(INTEROP)]
)
def test_written_tensors_and_config_are_what_consumers_load(tmp_path, fmt, kw, tensors, keys):
    d = write(tmp_path, fmt, {Q: qw(**kw)})
    header = read_safetensors_header(d / "model.safetensors")
    layer = {n[len(Q) + 1 :]: (t.dtype, list(t.shape)) for n, t in header.tensors.items() if n.startswith(Q)}
    assert layer == tensors
    assert {n for n in header.tensors if not n.startswith(Q)} == {
        "model.embed_tokens.weight",
        "model.norm.weight",
    }
    config = json.loads((d / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in keys} == keys
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    if fmt == "compressed-tensors":
        group = qc["config_groups"]["group_0"]
        assert group["targets"] == ["Linear"] and group["input_activations"] is None
        want = CT_WEIGHTS[0 if "act" in kw else 1]
        assert {k: group["weights"][k] for k in want} == want
    if fmt in ("gptq", "marlin"):
        assert json.loads((d / "quantize_config.json").read_text()) == qc
    if fmt == "gptq" and qc["sym"]:  # symmetric v1 zeros are 7 per nibble ("GPTQ zero points")
        assert (u32(raw(d)[f"{Q}.qzeros"]) == 0x77777777).all()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / name).read_text() == (tmp_path / "src" / name).read_text()


@pytest.mark.parametrize(("bits", "word"), [(2, 0x55555555), (8, 0x7F7F7F7F)])
def test_symmetric_v1_zero_words(tmp_path, bits, word):
    d = write(tmp_path, "gptq", {Q: qw(bits=bits)})
    assert (u32(raw(d)[f"{Q}.qzeros"]) == word).all()


# ---- hand-built files ---------------------------------------------------------------------------


def hf_dir(d: Path, tensors: dict[str, torch.Tensor], qc: dict[str, Any] | None) -> Path:
    d.mkdir(parents=True)
    config = dict(BASE_CONFIG) | ({"quantization_config": qc} if qc else {})
    (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    return d


def i32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((np.asarray(a, dtype=np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def np_pack_cols(v: np.ndarray) -> np.ndarray:
    """4-bit along columns, natural order: slot p of word c = column 8c + p."""
    return sum(v[:, p::8].astype(np.int64) << (4 * p) for p in range(8))


def test_asymmetric_v1_zeros_use_whole_word_arithmetic(tmp_path, caplog):
    """GPTQModel exports asymmetric v1 as packed(z) - 0x11111111 per word, borrows included
    ("GPTQ zero points")."""
    w = qw(sym=False)
    z = w.zeros.numpy().copy()
    z[:, 0] = 0  # a zero of 0 in slot 0 borrows from slot 1 of the same word
    stored = (np_pack_cols(z) - 0x11111111) % (1 << 32)
    tensors = {
        f"{Q}.qweight": i32(sum(w.qweight.numpy()[p::8].astype(np.int64) << (4 * p) for p in range(8))),
        f"{Q}.qzeros": i32(stored),
        f"{Q}.scales": w.scales,
        f"{Q}.g_idx": torch.arange(K, dtype=torch.int32) // 32,
    }
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False,
          "checkpoint_format": "gptq"}  # fmt: skip
    d = hf_dir(tmp_path / "m", tensors, qc)
    with caplog.at_level(logging.WARNING), open_quantized(d) as ck:
        got = ck.read_linear(Q)
    assert np.array_equal(got.zeros.numpy(), z) and torch.equal(got.qweight, w.qweight)
    per_slot = (np_unpack(stored.astype(np.uint32), 4, 1, N) + 1) & 15
    assert not np.array_equal(per_slot, z)  # the naive reader would be wrong here
    assert "may already be corrupt" in caplog.text
    # and our own explicit v1 export of the same weights reads back exactly
    w2 = QuantizedWeight(w.qweight, w.scales, torch.from_numpy(z), 4, 32)
    d2 = write(tmp_path, "gptq", {Q: w2}, checkpoint_format="gptq")
    assert json.loads((d2 / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq"
    assert np.array_equal(u32(raw(d2)[f"{Q}.qzeros"]), stored.astype(np.uint32))
    with open_quantized(d2) as ck:
        assert_same(ck.read_linear(Q), w2)


def test_missing_checkpoint_format_with_v2_content_reads_as_v2(tmp_path):
    """The content heuristic of "GPTQ zero points": symmetric 4-bit qzeros all 0x88888888 without
    checkpoint_format are raw zeros."""
    w = qw()
    d = write(tmp_path, "gptq", {Q: w}, checkpoint_format="gptq_v2")
    config = json.loads((d / "config.json").read_text())
    del config["quantization_config"]["checkpoint_format"]
    (d / "config.json").write_text(json.dumps(config))
    (d / "quantize_config.json").unlink()
    with open_quantized(d) as ck:
        assert_same(ck.read_linear(Q), w)


def test_awq_interleave_against_a_hand_built_word(tmp_path):
    q = (torch.arange(N, dtype=torch.uint8) % 16).repeat(K, 1)  # q[i, o] = o % 16
    w = QuantizedWeight(q, torch.ones(K // 32, N).half(), torch.zeros(K // 32, N, dtype=torch.uint8), 4, 32)
    d = write(tmp_path, "awq", {Q: w})
    # word 0 holds columns 0..7 in slot order [0, 2, 4, 6, 1, 3, 5, 7]: nibbles 7,5,3,1,6,4,2,0 from the top
    assert (u32(raw(d)[f"{Q}.qweight"])[:, 0] == 0x75316420).all()
    hand = hf_dir(
        tmp_path / "hand",
        {f"{Q}.qweight": i32(np.full((K, N // 8), 0x75316420)), f"{Q}.qzeros": i32(np.zeros((K // 32, N // 8))),
         f"{Q}.scales": torch.ones(K // 32, N).half()},
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    )  # fmt: skip
    with open_quantized(hand) as ck:
        assert torch.equal(ck.read_linear(Q).qweight, (torch.arange(N) % 8).to(torch.uint8).repeat(K, 1))


def test_awq_gemv_layout(tmp_path):
    """GEMV: qweight [N, K/8] natural order, qzeros [N, Wz] and scales [N, 8*Wz] padded along groups
    ("AWQ GEMV and GEMV_FAST"); G = 32 rounds Wz up to a multiple of 4 (AutoAWQ calculate_zeros_width)."""
    w = qw(sym=False, group=32)
    z = np.zeros((N, 32), dtype=np.int64)
    z[:, :4] = w.zeros.numpy().T
    s = torch.zeros(N, 32).half()
    s[:, :4] = w.scales.t()
    tensors = {
        f"{Q}.qweight": i32(np_pack_cols(w.qweight.numpy().T)),
        f"{Q}.qzeros": i32(np_pack_cols(z)),
        f"{Q}.scales": s,
    }
    d = hf_dir(
        tmp_path / "m", tensors, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    )
    with open_quantized(d) as ck:
        assert_same(ck.read_linear(Q), w)


def test_ct_is_gptq_transposed(tmp_path):
    """Per "compressed-tensors and GPTQ": weight_packed^T = qweight, weight_scale^T = scales,
    weight_zero_point^T = v2 qzeros, g_idx equal."""
    w = qw(sym=False, act=True)
    g = raw(write(tmp_path, "gptq", {Q: w}))
    c = raw(write(tmp_path, "compressed-tensors", {Q: w}))
    assert torch.equal(c[f"{Q}.weight_packed"].t(), g[f"{Q}.qweight"])
    assert torch.equal(c[f"{Q}.weight_scale"].t(), g[f"{Q}.scales"])
    assert torch.equal(c[f"{Q}.weight_zero_point"].t(), g[f"{Q}.qzeros"])
    assert torch.equal(c[f"{Q}.weight_g_idx"], g[f"{Q}.g_idx"])


def test_layer_split_across_shards(tmp_path):
    w = qw()
    # qweight is 4096 bytes: qzeros fits after it, scales start the second shard
    d = write(tmp_path, "gptq", {Q: w, DOWN: qw(seed=3)}, shard_bytes=4500)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert wm[f"{Q}.qweight"] != wm[f"{Q}.scales"] and len(set(wm.values())) >= 3
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in raw(d).values())
    spec = detect(d)
    assert spec.format == "gptq" and len(spec.files) == len(set(wm.values()))
    with open_quantized(spec) as ck:
        assert_same(ck.read_linear(Q), w)
        assert ck.dense_names() == ["model.embed_tokens.weight", "model.norm.weight"]


def test_gptqmodel_dynamic_overrides_and_skips(tmp_path):
    """`dynamic`: '-:' leaves a module dense ("GPTQ dynamic rules"); with per-module rules bits and group size
    follow the shapes ("Telling layouts apart"): down_proj is 8-bit group 64 although the rule matching it
    states neither."""
    q4, q8 = qw(), qw(bits=8, group=64, seed=2)
    t = raw(write(tmp_path, "gptq", {Q: q4})) | {
        k.replace(Q, DOWN): v
        for k, v in raw(write(tmp_path / "b", "gptq", {Q: q8})).items()
        if k.startswith(Q)
    }
    t["model.layers.0.self_attn.k_proj.weight"] = torch.randn(N, K).half()
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
          "dynamic": {r"+:.*down_proj": {"desc_act": False}, r"-:.*k_proj": {}}}  # fmt: skip
    d = hf_dir(tmp_path / "m", t, qc)
    with open_quantized(d) as ck:
        assert ck.linear_prefixes() == [DOWN, Q]
        assert_same(ck.read_linear(Q), q4)
        assert_same(ck.read_linear(DOWN), q8)
        assert "model.layers.0.self_attn.k_proj.weight" in ck.dense_names()


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors", "marlin"])
def test_layers_left_dense_are_declared(tmp_path, fmt):
    dense_q = "model.layers.1.self_attn.q_proj"
    d = write_quantized(
        tmp_path / "o",
        fmt,
        [(Q, qw(group=128), None)],
        [("model.embed_tokens.weight", torch.randn(32, K).half()), (f"{dense_q}.weight", torch.randn(N, K).half()),
         ("lm_head.weight", torch.randn(32, K).half())],
        {"model_type": "llama", "tie_word_embeddings": False},
    )  # fmt: skip
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    declared = {
        "gptq": lambda: list(qc["dynamic"]),
        "marlin": lambda: list(qc["dynamic"]),
        "awq": lambda: qc["modules_to_not_convert"],
        "compressed-tensors": lambda: qc["ignore"],
    }[fmt]()
    assert any(dense_q.replace(".", "\\.") in r or r == dense_q for r in declared)
    with open_quantized(d) as ck:
        assert ck.linear_prefixes() == [Q]
        assert set(ck.dense_names()) == {"model.embed_tokens.weight", f"{dense_q}.weight", "lm_head.weight"}


def test_zero_bias_can_be_dropped(tmp_path):
    d = write(tmp_path, "gptq", {Q: qw()}, bias=torch.zeros(N).half())
    with open_quantized(d) as ck:
        assert ck.read_bias(Q) is not None and ck.read_bias(Q, drop_zero=True) is None
        assert ck.read_bias(DOWN) is None


def test_failed_write_leaves_nothing(tmp_path):
    def layers():
        yield Q, qw(), None
        raise RuntimeError("quantizer crashed")

    with pytest.raises(RuntimeError):
        write_quantized(tmp_path / "o", "gptq", layers(), [], BASE_CONFIG)
    assert list(tmp_path.iterdir()) == []


# ---- error rows: the message names the tensor and the numbers ---------------------------------


def _edit(tmp: Path, fmt: str, kw: dict, change) -> Path:
    d = write(tmp, fmt, {Q: qw(**kw)})
    t = raw(d)
    config = json.loads((d / "config.json").read_text())
    change(t, config["quantization_config"])
    (d / "quantize_config.json").unlink(missing_ok=True)
    (d / "model.safetensors").unlink()
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config))
    return d


def _set(t: dict, name: str, value: torch.Tensor | None) -> None:
    if value is None:
        del t[name]
    else:
        t[name] = value


READ_ERRORS = [  # id, format, qw kwargs, edit, error type, message parts
    ("gptq-qzeros-shape", "gptq", {}, lambda t, qc: _set(t, f"{Q}.qzeros", torch.zeros(4, 4, dtype=torch.int32)),
     ModelFileError, [f"{Q}.qzeros", "[4, 4]", "[4, 8]"]),
    ("gptq-group-size", "gptq", {}, lambda t, qc: (_set(t, f"{Q}.g_idx", None), qc.update(group_size=64)),
     ModelFileError, [f"{Q}.scales", "4 scale groups", "K = 128", "group_size 64"]),
    ("gptq-missing-qzeros", "gptq", {}, lambda t, qc: _set(t, f"{Q}.qzeros", None),
     ModelFileError, [f"{Q}.qzeros", "missing"]),
    ("gptq-qweight-rows", "gptq", {}, lambda t, qc: _set(t, f"{Q}.qweight", torch.zeros(8, N, dtype=torch.int32)),
     ModelFileError, [Q, "K = 128", "2 bits"]),
    ("gptq-dynamic-5bit", "gptq", {},
     lambda t, qc: (qc.update(dynamic={".*q_proj": {"bits": 5}}), _set(t, f"{Q}.qweight", torch.zeros(20, N, dtype=torch.int32))),
     UnsupportedFormatError, [f"{Q}.qweight", "5-bit"]),
    ("ct-5bit", "compressed-tensors", {}, lambda t, qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=5),
     UnsupportedFormatError, [f"{Q}.weight_packed", "5-bit"]),
    ("ct-weight-shape", "compressed-tensors", {},
     lambda t, qc: _set(t, f"{Q}.weight_shape", torch.tensor([32, K])), ModelFileError,
     [f"{Q}.weight_shape", "[32, 128]", "N=64"]),
    ("awq-qzeros-shape", "awq", {"sym": False}, lambda t, qc: _set(t, f"{Q}.qzeros", torch.zeros(4, 2, dtype=torch.int32)),
     ModelFileError, [f"{Q}.qzeros", "[4, 2]", "[4, 8]"]),
    ("awq-gemv-fast", "awq", {"sym": False},
     lambda t, qc: (qc.update(version="gemv_fast"), _set(t, f"{Q}.qweight", t[f"{Q}.qweight"].to(torch.int16))),
     UnsupportedFormatError, ["gemv_fast", "gemm"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "kw", "change", "exc", "parts"), [r[1:] for r in READ_ERRORS], ids=[r[0] for r in READ_ERRORS]
)
def test_read_errors_name_tensor_and_numbers(tmp_path, fmt, kw, change, exc, parts):
    d = _edit(tmp_path, fmt, kw, change)
    with pytest.raises(exc) as e, open_quantized(d) as ck:
        ck.read_linear(Q)
    for part in parts:
        assert part in str(e.value), (part, str(e.value))


WRITE_ERRORS = [  # id, format, layers, message parts
    ("awq-8bit", "awq", {Q: qw(bits=8)}, ["AWQ", Q, "8-bit"]),
    ("awq-act-order", "awq", {Q: qw(act=True)}, ["AWQ", Q, "act-order"]),
    ("gptq-mixed-sym", "gptq", {Q: qw(), DOWN: qw(sym=False)}, [Q, DOWN, "symmetry", "asym"]),  # bits may mix
    ("gptq-3bit-k", "gptq", {Q: qw(bits=3, k=80, group=16)}, [Q, "K=80", "3 bits"]),
    ("marlin-n48", "marlin", {Q: qw(n=48)}, ["Marlin", "N=48"]),
    ("marlin-8bit-asym", "marlin", {Q: qw(bits=8, sym=False)}, ["asymmetric 8-bit"]),
    ("ct-late-act-order", "compressed-tensors", {Q: qw(), DOWN: qw(act=True)}, [DOWN, "act_order=True"]),
]


@pytest.mark.parametrize(
    ("fmt", "weights", "parts"), [r[1:] for r in WRITE_ERRORS], ids=[r[0] for r in WRITE_ERRORS]
)
def test_write_errors_say_what_to_do(tmp_path, fmt, weights, parts):
    with pytest.raises(ConfigError) as e:
        write(tmp_path, fmt, weights)
    for part in parts:
        assert part in str(e.value), (part, str(e.value))
    assert not (tmp_path / f"out-{fmt}").exists()


def test_dense_checkpoint_opens_with_no_quantized_linears(tmp_path):
    d = hf_dir(
        tmp_path / "m", {f"{Q}.weight": torch.randn(N, K).half(), "model.norm.weight": torch.ones(K)}, None
    )
    with open_quantized(d) as ck:
        assert ck.format == "safetensors" and ck.linear_prefixes() == []
        assert sorted(ck.dense_names()) == [f"{Q}.weight", "model.norm.weight"]
        assert ck.read_dense("model.norm.weight").dtype == torch.float32
        with pytest.raises(KeyError):
            ck.read_linear(Q)


def test_every_scheme_has_one_writer_and_each_states_what_it_can_be_repacked_to(tmp_path):
    """The scheme registry's writable formats and the writer registry (converters.hf_quant) are the same, the float
    schemes (FP8, MXFP4) are read only, and a scheme's repack targets are what the writers then accept."""
    from quantserve.converters.calibration.quantize import repack_checkpoint
    from quantserve.converters.hf_quant import writers
    from quantserve.formats.schemes import writable_schemes

    floats = {name for name, cls in schemes().items() if cls.float_weights}
    assert set(writers()) == set(writable_schemes()) == set(schemes()) - floats - {"compressed-tensors-int8"}
    sym8 = detect(write(tmp_path / "a", "gptq", {Q: qw(bits=8, group=32)})).scheme
    assert set(sym8.repack_targets()) == {"compressed-tensors", "gptq", "marlin"}
    act4 = detect(write(tmp_path / "b", "gptq", {Q: qw(act=True)})).scheme
    assert act4.desc_act and "awq" not in act4.repack_targets() and "marlin" in act4.repack_targets()
    with pytest.raises(
        ConfigError, match=r"cannot be written as awq: AWQ is 4-bit only, these weights are 8-bit"
    ):
        repack_checkpoint(tmp_path / "a" / "out-gptq", tmp_path / "out", "awq")
    assert not (tmp_path / "out").exists()
    repack_checkpoint(tmp_path / "a" / "out-gptq", tmp_path / "out", "marlin")
    assert detect(tmp_path / "out").scheme.describe() == {"bits": 8, "group_size": 32}
