"""detect() truth table over generated checkpoints (incl. error rows), split GGUFs, and summarize()."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from quantserve.errors import ModelFileError, ModelNotFoundError, UnsupportedFormatError
from quantserve.formats import detect, render_summary, summarize
from tests.fixtures.formats import (
    Q_PROJ,
    K,
    N,
    awq_layer,
    ct_layer,
    dense_tensors,
    gptq_layer,
    marlin_layer,
    quantized_model,
    write_gguf,
    write_hf,
    write_raw_safetensors,
    write_sharded,
)

GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
AWQ_CFG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
CT_CFG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
        }
    },
    "ignore": ["lm_head"],
}


def _gguf_dir(tmp: Path) -> Path:
    write_gguf(tmp / "m" / "model.gguf")
    return tmp / "m"


def _gguf_renamed(tmp: Path) -> Path:
    (tmp / "m").mkdir()
    return write_gguf(tmp / "m" / "model.gguf").rename(tmp / "m" / "weights.bin")


def _bf16(tmp: Path) -> Path:
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text('{"model_type": "llama"}')
    data = np.ones((N, K), dtype=np.float32).view(np.uint32) >> 16  # bf16 = top half of fp32
    write_raw_safetensors(
        tmp / "m" / "model.safetensors", {"w.weight": ("BF16", [N, K], data.astype("<u2").tobytes())}
    )
    return tmp / "m"


def _single_file(tmp: Path) -> Path:
    save_file(dense_tensors(np.float32), str(tmp / "weights.bin"))  # the name says nothing; bytes decide
    return tmp / "weights.bin"


def _gptq_v2(tmp: Path) -> Path:
    return write_hf(
        tmp / "m", quantized_model(gptq_layer(Q_PROJ)), GPTQ_CFG | {"checkpoint_format": "gptq_v2"}
    )


def _gptq_only_quantize_config(tmp: Path) -> Path:
    qc = {"bits": 4, "group_size": 32, "desc_act": False, "sym": True}  # old AutoGPTQ: no quant_method
    return write_hf(tmp / "m", quantized_model(gptq_layer(Q_PROJ)), extra_files={"quantize_config.json": qc})


def _marlin(tmp: Path) -> Path:
    qc = {"quant_method": "gptq", "checkpoint_format": "marlin", "bits": 4, "group_size": 128, "sym": True}
    return write_hf(tmp / "m", quantized_model(marlin_layer(Q_PROJ)), qc)


def _zip_bin(tmp: Path) -> Path:
    (tmp / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + bytes(60))
    return tmp / "pytorch_model.bin"


def _raw_pickle(tmp: Path) -> Path:
    (tmp / "model.pt").write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=4))  # written, never read
    return tmp / "model.pt"


def _pickle_as_safetensors(tmp: Path) -> Path:
    (tmp / "model.safetensors").write_bytes(pickle.dumps({"w": 1}, protocol=2))
    return tmp / "model.safetensors"


def _pickle_dir(tmp: Path) -> Path:
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text("{}")
    _zip_bin(tmp / "m")
    return tmp / "m"


def _only_config(tmp: Path) -> Path:
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text('{"model_type": "llama"}')
    return tmp / "m"


def _mix(tmp: Path) -> Path:
    write_hf(tmp / "m", dense_tensors())
    write_gguf(tmp / "m" / "model.gguf")
    return tmp / "m"


def _missing_shard(tmp: Path) -> Path:
    write_sharded(tmp / "m", dense_tensors())
    (tmp / "m" / "model-00002-of-00002.safetensors").unlink()
    return tmp / "m"


def _index_escape(tmp: Path) -> Path:
    write_sharded(tmp / "m", dense_tensors())
    index = json.loads((tmp / "m" / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../model-00001-of-00002.safetensors"
    (tmp / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp / "m"


def _truncated(tmp: Path) -> Path:
    write_hf(tmp / "m", dense_tensors())
    f = tmp / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return tmp / "m"


def _two_gguf(tmp: Path) -> Path:
    write_gguf(tmp / "m" / "a.gguf")
    write_gguf(tmp / "m" / "b.gguf")
    return tmp / "m"


def _gguf_with_mmproj(tmp: Path) -> Path:
    write_gguf(tmp / "m" / "model.gguf")
    write_gguf(tmp / "m" / "proj.gguf", general_type="mmproj", arch="clip")
    return tmp / "m"


def _text_file(tmp: Path) -> Path:
    (tmp / "README.md").write_text("# a model card, not a model\n")
    return tmp / "README.md"


OK_ROWS = [
    ("gguf-dir", _gguf_dir, "gguf", {"file_type": "Q4_1", "version": 3}, "llama"),
    ("gguf-file", lambda t: write_gguf(t / "x.gguf"), "gguf", {"file_type": "Q4_1"}, "llama"),
    ("gguf-renamed-bin", _gguf_renamed, "gguf", {"file_type": "Q4_1"}, "llama"),
    ("gguf+mmproj", _gguf_with_mmproj, "gguf", {"file_type": "Q4_1"}, "llama"),
    ("fp16", lambda t: write_hf(t / "m", dense_tensors()), "safetensors", {"dtype": "float16"}, "llama"),
    ("bf16", _bf16, "safetensors", {"dtype": "bfloat16"}, "llama"),
    ("fp32-single-file", _single_file, "safetensors", {"dtype": "float32"}, None),
    (
        "sharded-index",
        lambda t: write_sharded(t / "m", dense_tensors()),
        "safetensors",
        {"dtype": "float16"},
        "llama",
    ),
    (
        "gptq-v1-sym",
        lambda t: write_hf(t / "m", quantized_model(gptq_layer(Q_PROJ)), GPTQ_CFG),
        "gptq",
        {"bits": 4, "group_size": 32, "sym": True, "desc_act": False, "checkpoint_format": "gptq"},
        "llama",
    ),
    ("gptq-v2", _gptq_v2, "gptq", {"checkpoint_format": "gptq_v2", "bits": 4}, "llama"),
    (
        "gptq-asym-desc_act-8bit",
        lambda t: write_hf(
            t / "m",
            quantized_model(gptq_layer(Q_PROJ, bits=8, group=-1)),
            GPTQ_CFG | {"bits": 8, "group_size": -1, "sym": False, "desc_act": True},
        ),
        "gptq",
        {"bits": 8, "group_size": -1, "sym": False, "desc_act": True},
        "llama",
    ),
    (
        "gptq-quantize_config-only",
        _gptq_only_quantize_config,
        "gptq",
        {"bits": 4, "group_size": 32, "sym": True},
        "llama",
    ),
    (
        "awq-gemm",
        lambda t: write_hf(t / "m", quantized_model(awq_layer(Q_PROJ)), AWQ_CFG),
        "awq",
        {"bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        "llama",
    ),
    ("marlin", _marlin, "marlin", {"bits": 4, "group_size": 128}, "llama"),
    (
        "compressed-tensors",
        lambda t: write_hf(t / "m", quantized_model(ct_layer(Q_PROJ)), CT_CFG),
        "compressed-tensors",
        {"format": "pack-quantized", "num_bits": 4, "group_size": 32, "symmetric": True, "strategy": "group"},
        "llama",
    ),
]

ERROR_ROWS = [
    ("pickle-zip-bin", _zip_bin, UnsupportedFormatError, "pickled PyTorch checkpoint"),
    ("pickle-raw-pt", _raw_pickle, UnsupportedFormatError, "Convert it to safetensors"),
    ("pickle-named-safetensors", _pickle_as_safetensors, UnsupportedFormatError, "never unpickles"),
    ("pickle-dir", _pickle_dir, UnsupportedFormatError, "pytorch_model.bin"),
    ("empty-dir", lambda t: (t / "m").mkdir() or t / "m", ModelFileError, "empty"),
    ("only-config", _only_config, ModelFileError, "no weights found (saw config.json"),
    ("gguf+safetensors", _mix, ModelFileError, "mixes model formats"),
    ("two-gguf-models", _two_gguf, ModelFileError, "a.gguf"),
    ("missing-shard", _missing_shard, ModelFileError, "model-00002-of-00002.safetensors"),
    ("index-path-escape", _index_escape, ModelFileError, "not a plain file name"),
    ("truncated-safetensors", _truncated, ModelFileError, "truncated"),
    (
        "gptq-config-awq-tensors",
        lambda t: write_hf(t / "m", quantized_model(awq_layer(Q_PROJ)), GPTQ_CFG),
        ModelFileError,
        "AWQ GEMM-shaped",
    ),
    (
        "gptq-config-wrong-bits",
        lambda t: write_hf(t / "m", quantized_model(gptq_layer(Q_PROJ, bits=8)), GPTQ_CFG),
        ModelFileError,
        "says bits 4",
    ),
    (
        "awq-config-dense-tensors",
        lambda t: write_hf(t / "m", dense_tensors(), AWQ_CFG),
        ModelFileError,
        "no '*.qweight' tensors",
    ),
    (
        "quantized-no-config",
        lambda t: write_hf(t / "m", quantized_model(gptq_layer(Q_PROJ))),
        ModelFileError,
        "GPTQ",
    ),
    (
        "bitsandbytes",
        lambda t: write_hf(t / "m", dense_tensors(), {"quant_method": "bitsandbytes", "load_in_4bit": True}),
        UnsupportedFormatError,
        "bitsandbytes",
    ),
    ("nonexistent", lambda t: t / "nope", ModelNotFoundError, "nope"),
    ("not-a-model", _text_file, ModelFileError, "not a model file"),
]


@pytest.mark.parametrize(
    ("build", "fmt", "quant", "arch"), [r[1:] for r in OK_ROWS], ids=[r[0] for r in OK_ROWS]
)
def test_detect_ok(tmp_path, build, fmt, quant, arch):
    path = build(tmp_path)
    spec = detect(path)
    assert spec.format == fmt
    assert {k: spec.quant.get(k) for k in quant} == quant
    assert spec.architecture == arch
    assert spec.path == path
    assert spec.files and all(f.is_file() for f in spec.files)


@pytest.mark.parametrize(
    ("build", "exc", "needle"), [r[1:] for r in ERROR_ROWS], ids=[r[0] for r in ERROR_ROWS]
)
def test_detect_errors(tmp_path, build, exc, needle):
    path = build(tmp_path)
    with pytest.raises(exc) as info:
        detect(path)
    assert info.type is exc  # exactly this class, not a sibling that happens to subclass it
    assert needle in info.value.message


def test_sharded_files_and_config(tmp_path):
    spec = detect(write_sharded(tmp_path / "m", dense_tensors(), n_shards=3))
    assert [f.name for f in spec.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert spec.config == {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def test_gguf_split_parts_in_order(tmp_path):
    first = write_gguf(tmp_path / "m" / "tiny.gguf", split_max_tensors=2)
    assert first.name == "tiny-00001-of-00002.gguf"
    for given in (tmp_path / "m", first, first.with_name("tiny-00002-of-00002.gguf")):
        spec = detect(given)
        assert [f.name for f in spec.files] == ["tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"]
        assert spec.architecture == "llama"
    # renamed parts are still found and ordered by their split.no metadata, not their names
    (tmp_path / "m" / "tiny-00001-of-00002.gguf").rename(tmp_path / "m" / "zz.bin")
    (tmp_path / "m" / "tiny-00002-of-00002.gguf").rename(tmp_path / "m" / "aa.bin")
    assert [f.name for f in detect(tmp_path / "m" / "zz.bin").files] == ["zz.bin", "aa.bin"]
    (tmp_path / "m" / "aa.bin").unlink()
    with pytest.raises(ModelFileError, match="1 part\\(s\\) are missing"):
        detect(tmp_path / "m" / "zz.bin")


def test_summary_real_model(smollm2_gguf):
    s = summarize(smollm2_gguf)
    spec = detect(smollm2_gguf)
    assert (s.format, s.architecture, s.context_length) == ("gguf", "llama", 8192)
    assert s.quant["file_type"] == "Q4_1" and s.quant_types["attn_q"] == "Q4_1"
    assert s.quant_types["token_embd"] == "Q8_0" and s.quant_types["output_norm"] == "F32"
    assert s.n_params == 134_515_008  # sum of ne products over the 272 tensors
    assert s.file_size == smollm2_gguf.stat().st_size and s.files == spec.files
    assert 4.5 < s.bits_per_weight < 6.5  # Q4_1 is 5.0; Q8_0 embeddings and F32 norms add a little
    text = render_summary(s)
    for needle in ("gguf", "llama", "134.5M", "Q4_1", "8192"):
        assert needle in text
    value_columns = {re.match(r"^[a-z ]+:\s+", line).end() for line in text.splitlines() if line[0] != " "}
    assert len(value_columns) == 1  # every value starts in the same column


def test_summary_gptq_counts_packed_weights(tmp_path):
    tensors = quantized_model(gptq_layer(Q_PROJ))
    s = summarize(write_hf(tmp_path / "m", tensors, GPTQ_CFG))
    dense = sum(v.size for k, v in tensors.items() if not k.startswith(Q_PROJ))
    assert s.n_params == dense + K * N  # the packed q_proj counts as K*N weights; scales/zeros/g_idx don't
    assert s.quant_types["q_proj"] == "GPTQ int4 g32" and s.quant_types["embed_tokens"] == "F16"
    assert s.context_length == 2048


def test_summary_dense_bits(tmp_path):
    assert summarize(write_hf(tmp_path / "m", dense_tensors())).bits_per_weight == pytest.approx(16.0)


BAD_CONFIGS = [
    ("bits-word", GPTQ_CFG | {"bits": "four"}, "not an integer"),
    ("bits-list", GPTQ_CFG | {"bits": [4]}, "not an integer"),
    ("bits-missing", {"quant_method": "gptq", "group_size": 32}, "missing 'bits'"),
    ("gptq-planar", GPTQ_CFG | {"checkpoint_format": "gptq_p"}, "gptq_p"),
    ("awq-version", AWQ_CFG | {"version": "turbo"}, "turbo"),
    ("ct-no-groups", {"quant_method": "compressed-tensors", "format": "pack-quantized"}, "config_groups"),
    ("ct-fp8", CT_CFG | {"format": "float-quantized"}, "float-quantized"),
    ("qc-list", ["gptq"], "expected an object"),
]


@pytest.mark.parametrize(("qc", "needle"), [b[1:] for b in BAD_CONFIGS], ids=[b[0] for b in BAD_CONFIGS])
def test_malformed_quant_configs(tmp_path, qc, needle):
    d = write_hf(tmp_path / "m", quantized_model(gptq_layer(Q_PROJ)), qc)
    with pytest.raises(ModelFileError) as err:  # UnsupportedFormatError is a ModelFileError too
        detect(d)
    assert needle in err.value.message


def test_broken_config_json(tmp_path):
    d = write_hf(tmp_path / "m", dense_tensors())
    (d / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelFileError, match="config.json: cannot parse JSON"):
        detect(d)
