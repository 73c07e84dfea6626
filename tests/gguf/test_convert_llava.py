"""LLaVA -> GGUF: the text model and the vision projector (mmproj), checked byte for byte against llama.cpp's own
converters, loaded by libmtmd, written by `quantserve convert`, recognised by `inspect` and models.toml.

The oracles are the llama.cpp sources vendored in the llama-cpp-python sdist that `make test` downloads:
convert_hf_to_gguf.py for the text model, and for the projector the legacy LLaVA recipe its docs give for an HF
checkpoint (docs/multimodal/llava.md, granitevision.md): llava_surgery_v2.py, then convert_image_encoder_to_gguf.py
--clip-model-is-vision --llava-projector (convert_hf_to_gguf.py --mmproj takes pixtral-style LLaVAs only). Two shims
let them run here, neither touching what they write: an empty `sentencepiece` module (the text converter imports it
before finding that there is no tokenizer.model), and transformers 4's `CLIPVisionModel.vision_model` level, which
transformers 5 dropped and the legacy script walks.
"""

from __future__ import annotations

import ctypes
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from quantserve.backends.select import plan_model
from quantserve.cli import main
from quantserve.converters import hf_to_gguf, hf_to_mmproj
from quantserve.core.settings import EngineSettings
from quantserve.errors import ModelFileError, ModelNotFoundError, UnsupportedFormatError
from quantserve.formats import detect, find_mmproj, read_gguf_info
from quantserve.gguf.mmproj import vision_params
from quantserve.gguf.params import normalize_hparams
from quantserve.registry import load_registry, resolve
from tests.conftest import run_python
from tests.fixtures.vision import build_tiny_llava

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

NAME = "tiny-llava"  # every copy of the checkpoint has this directory name: general.name comes from it
MEAN, STD = ["0.48145466", "0.4578275", "0.40821073"], ["0.26862954", "0.26130258", "0.27577711"]

RUN_LEGACY = """import runpy, sys, torch
from transformers.models.clip.modeling_clip import CLIPVisionModel
_load = CLIPVisionModel.from_pretrained
class CLIPVisionModel4(torch.nn.Module):  # transformers 4's layout: the tower under .vision_model
    def __init__(self, inner):
        super().__init__()
        self.vision_model = inner
CLIPVisionModel.from_pretrained = classmethod(lambda cls, path, **kw: CLIPVisionModel4(_load(path, **kw)))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _rename(src: Path, dst: Path, rules: list[tuple[str, str]]) -> Path:
    """A copy of the checkpoint with its tensors renamed (first matching prefix rule), other files as they are."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = safetensors_numpy.load_file(src / "model.safetensors")
    renamed = {}
    for name, value in tensors.items():
        old, new = next(((o, n) for o, n in rules if name.startswith(o)), ("", ""))
        renamed[new + name[len(old) :]] = value
    safetensors_numpy.save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def layouts(smollm2_hf, tmp_path_factory) -> dict[str, Path]:
    """The tiny LLaVA under the three tensor layouts: what transformers 5 saves (language_model.model.*,
    vision_tower.*), llava-hf's published one (vision_tower.vision_model.*), transformers 5's in-memory one."""
    tmp = tmp_path_factory.mktemp("llava")
    saved = build_tiny_llava(tmp / "saved" / NAME, smollm2_hf)
    llava_hf = _rename(saved, tmp / "llava-hf" / NAME, [("vision_tower.", "vision_tower.vision_model.")])
    in_memory = _rename(saved, tmp / "in-memory" / NAME, [
        ("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
    ])  # fmt: skip
    return {"saved": saved, "llava-hf": llava_hf, "in-memory": in_memory}


@pytest.fixture(scope="module")
def oracle_mmproj(vendored, layouts, tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's legacy LLaVA recipe on the llava-hf layout: surgery, a vision-only CLIP directory, convert."""
    tmp = tmp_path_factory.mktemp("oracle-mmproj")
    legacy = vendored / "tools/mtmd/legacy-models"
    surgery = tmp / "surgery" / NAME
    surgery.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(layouts["llava-hf"] / f, surgery / f)
    run_python([legacy / "llava_surgery_v2.py", "-C", "-m", surgery], vendored / "gguf-py", tmp)
    vit = tmp / "vit" / NAME  # the docs' step: llava.clip as pytorch_model.bin beside a vision config
    vit.mkdir(parents=True)
    shutil.copy(surgery / "llava.clip", vit / "pytorch_model.bin")
    config = json.loads((surgery / "config.json").read_text())
    vision = {**config["vision_config"], "vision_feature_layer": config["vision_feature_layer"]}
    (vit / "config.json").write_text(json.dumps(vision))
    (tmp / "run_legacy.py").write_text(RUN_LEGACY)
    out = {}
    for kind, flags in (("f16", []), ("f32", ["--use-f32"])):
        args = [tmp / "run_legacy.py", legacy / "convert_image_encoder_to_gguf.py", "-m", vit, "--llava-projector",
                surgery / "llava.projector", "--output-dir", tmp / "out", "--clip-model-is-vision",
                "--image-mean", *MEAN, "--image-std", *STD, *flags]  # fmt: skip
        run_python(args, vendored / "gguf-py", tmp)
        out[kind] = tmp / "out" / f"mmproj-model-{kind}.gguf"
    return out


@pytest.fixture(scope="module")
def oracle_text(vendored, layouts, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("oracle-text")
    (tmp / "shim").mkdir()
    (tmp / "shim/sentencepiece.py").write_text("class SentencePieceProcessor: ...\n")
    out = tmp / "text-f16.gguf"
    run_python([vendored / "convert_hf_to_gguf.py", layouts["saved"], "--outfile", out, "--outtype", "f16"],
            tmp / "shim", tmp)  # fmt: skip
    return out


@pytest.mark.parametrize("kind", ["f16", "f32"])
def test_mmproj_equals_llama_cpp_byte_for_byte(kind, layouts, oracle_mmproj, tmp_path):
    expected = oracle_mmproj[kind].read_bytes()
    for layout, src in layouts.items():
        ours = hf_to_mmproj(src, tmp_path / f"{layout}.gguf", kind)
        assert ours.read_bytes() == expected, (
            f"{layout} layout differs from the legacy converter's {kind} file"
        )
    info = read_gguf_info(tmp_path / "saved.gguf")
    types = {t.name: t.type_name for t in info.tensors}
    # as the legacy script writes them even with --use-f32: the projector matrices and the conv kernel stay F16
    assert types["mm.0.weight"] == types["v.patch_embd.weight"] == "F16"
    assert types["v.blk.0.attn_q.weight"] == kind.upper() and types["mm.0.bias"] == "F32"
    assert info.get("clip.vision.block_count") == 2 and "v.blk.2.attn_q.weight" not in types  # 3 layers, -2
    assert info.get("clip.vision.feature_layer") == [2] and info.get("clip.projector_type") == "mlp"


def _kv_without(path: Path, key: str) -> dict:
    return {k: v for k, v in read_gguf_info(path).metadata.items() if k != key}


def _tensors(path: Path) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    mm = np.memmap(path, np.uint8, mode="r")
    return [(t.name, t.type_name, t.shape, mm[t.offset : t.offset + t.n_bytes].tobytes())
            for t in read_gguf_info(path).tensors]  # fmt: skip


def test_text_gguf_equals_convert_hf_to_gguf(layouts, oracle_text, tmp_path):
    ref = read_gguf_info(oracle_text)
    # The one difference: the vendored gguf-py's SpecialVocab also writes add_eos_token = False for a ByteLevel
    # post-processor; the gguf 0.19 wheel our writer uses leaves the key out. False is llama.cpp's default anyway.
    assert ref.get("tokenizer.ggml.add_eos_token") is False
    for layout, src in layouts.items():
        ours = hf_to_gguf(src, tmp_path / f"{layout}.gguf", "f16", progress=False)
        assert "tokenizer.ggml.add_eos_token" not in read_gguf_info(ours).metadata
        kv = read_gguf_info(ours).metadata
        expected = _kv_without(oracle_text, "tokenizer.ggml.add_eos_token")
        assert list(kv) == list(expected), layout  # same keys, same order
        assert kv == expected, layout
        assert _tensors(ours) == _tensors(oracle_text), layout
    tokens, types = ref.get("tokenizer.ggml.tokens"), ref.get("tokenizer.ggml.token_type")
    image_id = json.loads((layouts["saved"] / "config.json").read_text())["image_token_index"]
    assert tokens[image_id] == "<image>" and types[image_id] == 3  # CONTROL
    assert {t.name for t in ref.tensors} >= {"output.weight", "token_embd.weight", "blk.1.attn_q.weight"}
    assert not any(t.name.startswith(("v.", "mm.")) for t in ref.tensors)


def _simulate_vendored_graph(model, pixels: np.ndarray, n_layers: int) -> np.ndarray:
    """What the vendored clip.cpp LLaVA graph computes (models/llava.cpp): the class embedding concatenated after
    the patches with positions 0..576, rows 1..576 kept (llama.cpp issue #25814), tanh-GELU projector."""
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    emb = tower.embeddings
    with torch.no_grad():
        patches = emb.patch_embedding(torch.from_numpy(pixels)).flatten(2).transpose(1, 2)  # [1, 576, C]
        h = (
            torch.cat([patches, emb.class_embedding.reshape(1, 1, -1)], 1)
            + emb.position_embedding.weight[None]
        )
        h = tower.pre_layrnorm(h)
        for layer in tower.encoder.layers[:n_layers]:
            out = layer(h, None)
            h = out[0] if isinstance(out, tuple) else out
        y = projector.linear_2(torch.nn.functional.gelu(projector.linear_1(h[:, 1:]), approximate="tanh"))
    return y[0].numpy()


def test_libmtmd_loads_the_mmproj_and_runs_its_layers(layouts, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")
    src = layouts["saved"]
    text = hf_to_gguf(src, tmp_path / "text.gguf", "f32", progress=False)
    mmproj = hf_to_mmproj(src, tmp_path / "mmproj.gguf", "f32")
    llm = llama_cpp.Llama(str(text), n_ctx=64, n_threads=1, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.warmup, params.print_timings = False, 1, False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert ctx, "libmtmd refused the mmproj"
    try:
        assert mtmd.mtmd_support_vision(ctx)
        image = np.random.default_rng(0).integers(0, 256, (336, 336, 3), dtype=np.uint8)  # no resize needed
        bitmap = mtmd.mtmd_bitmap_init(
            336, 336, (ctypes.c_uint8 * image.size).from_buffer_copy(image.tobytes())
        )
        chunks = mtmd.mtmd_input_chunks_init()
        prompt = mtmd.mtmd_input_text()
        prompt.text = marker = mtmd.mtmd_default_marker()
        prompt.text_len, prompt.add_special, prompt.parse_special = len(marker), False, True
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(prompt), bitmaps, 1) == 0
        image_chunks = [c for i in range(mtmd.mtmd_input_chunks_size(chunks))
                        if mtmd.mtmd_input_chunk_get_type(c := mtmd.mtmd_input_chunks_get(chunks, i)) == 1]  # fmt: skip
        n = mtmd.mtmd_input_chunk_get_n_tokens(image_chunks[0])
        assert n == 576 and mtmd.mtmd_encode_chunk(ctx, image_chunks[0]) == 0
        got = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * 64,)).reshape(n, 64).copy()
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    finally:
        mtmd.mtmd_free(ctx)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    mean, std = np.array([float(x) for x in MEAN], np.float32), np.array([float(x) for x in STD], np.float32)
    pixels = ((image / np.float32(255) - mean) / std).astype(np.float32).transpose(2, 0, 1)[None]
    want = _simulate_vendored_graph(model, pixels, n_layers=2)  # vision_feature_layer -2 of 3 layers
    rel = np.abs(got - want).mean() / np.abs(want).mean()
    assert rel < 2e-3, (
        f"libmtmd's LLaVA embeddings are {rel:.2g} from the vendored graph's; if llama.cpp fixed its CLS order "
        "(issue #25814), compare with transformers' get_image_features instead"
    )  # measured 5.6e-4; one layer fewer or more (without clip.vision.feature_layer) is ~0.2 away


def test_convert_cli_writes_the_text_gguf_and_the_mmproj(layouts, smollm2_hf, tmp_path):
    src = layouts["saved"]
    r = CliRunner().invoke(
        main, ["convert", "--src", str(src), "--dst", str(tmp_path / "out"), "--quant", "q8_0"]
    )
    assert r.exit_code == 0, r.output
    text, mmproj = tmp_path / "out/Tiny-Llava-6.4M-Q8_0.gguf", tmp_path / "out/mmproj-Tiny-Llava-F16.gguf"
    processor = sorted(
        p.name for p in src.iterdir() if p.name in ("processor_config.json", "preprocessor_config.json")
    )
    assert processor  # copied beside the mmproj, where the llama.cpp backend reads how to crop images
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [text.name, mmproj.name, *processor]
    )
    assert f"wrote {text}" in r.output and f"wrote {mmproj}" in r.output
    assert read_gguf_info(text).file_type == "Q8_0"
    assert mmproj.read_bytes() == hf_to_mmproj(src, tmp_path / "lib.gguf").read_bytes()
    r = CliRunner().invoke(main, ["convert", "--src", str(src), "--dst", str(tmp_path / "m.gguf"), "--quant", "f16",
                                  "--mmproj-type", "f32"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert read_gguf_info(tmp_path / "mmproj-Tiny-Llava-F32.gguf").get("general.file_type") == 0
    r = CliRunner().invoke(
        main, ["convert", "--src", str(src), "--dst", str(tmp_path / "out"), "--quant", "q8_0"]
    )
    assert r.exit_code == 2 and "already exists" in r.output and "--force" in r.output
    r = CliRunner().invoke(main, ["convert", "--src", str(smollm2_hf), "--dst", str(tmp_path / "s.gguf"),
                                  "--quant", "f16", "--mmproj-type", "f16"])  # fmt: skip
    assert r.exit_code == 2 and "--mmproj-type applies to LLaVA" in r.output


def test_inspect_tells_a_llava_and_its_projector(layouts, tmp_path):
    src = layouts["saved"]
    r = CliRunner().invoke(main, ["inspect", str(src)])  # no CUDA here: llama.cpp, after conversion
    assert r.exit_code == 0, r.output
    assert "llamacpp — no CUDA GPU" in r.output and "write the vision projector (mmproj)" in r.output
    assert "vision, embeddings" in r.output
    r = CliRunner().invoke(main, ["inspect", str(src), "--backend", "torch"])
    assert r.exit_code == 0, r.output
    assert "LLaVA: clip_vision_model tower (3 blocks" in r.output and "torch — asked for" in r.output
    assert "load the CLIP vision tower" in r.output
    text = hf_to_gguf(src, tmp_path / "m.gguf", "q8_0", progress=False)
    r = CliRunner().invoke(main, ["inspect", str(text)])
    assert "images through" not in r.output  # no projector yet
    mmproj = hf_to_mmproj(src, tmp_path / "mmproj-m-F16.gguf")
    r = CliRunner().invoke(main, ["inspect", str(mmproj)])
    assert r.exit_code == 0, r.output
    assert "vision projector (mmproj): 2-block ViT, 336 px images in 14 px patches" in r.output
    assert "not a model" in r.output
    r = CliRunner().invoke(main, ["inspect", str(text)])
    assert f"images through {mmproj.name}" in r.output and "(libmtmd)" in r.output


def test_models_toml_mmproj_explicit_beside_and_missing(layouts, smollm2_gguf, tmp_path):
    src = layouts["saved"]
    (tmp_path / "llava").mkdir()
    text = hf_to_gguf(src, tmp_path / "llava/text.gguf", "q8_0", progress=False)
    mmproj = hf_to_mmproj(src, tmp_path / "projectors/mmproj-tiny-F16.gguf")
    toml = tmp_path / "models.toml"
    toml.write_text(
        '[models.explicit]\nsource = "llava/text.gguf"\nmmproj = "projectors/mmproj-tiny-F16.gguf"\n'
        '[models.plain]\nsource = "llava/text.gguf"\n'
        '[models.missing]\nsource = "llava/text.gguf"\nmmproj = "projectors/nope.gguf"\n'
    )
    reg = load_registry(toml)
    assert resolve("explicit", reg).mmproj == mmproj
    assert resolve("plain", reg).mmproj is None and find_mmproj(text) is None
    with pytest.raises(ModelNotFoundError) as e:
        resolve("missing", reg)
    assert str(tmp_path / "projectors/nope.gguf") in e.value.message and "fix the path" in e.value.message
    r = CliRunner().invoke(main, ["inspect", "explicit", "--models-file", str(toml)])
    assert f"images through {mmproj.name}" in r.output, r.output

    beside = shutil.copy(
        mmproj, tmp_path / "llava/mmproj-tiny-F16.gguf"
    )  # found by its metadata, not its name
    assert find_mmproj(text) == beside and find_mmproj(tmp_path / "llava") == beside
    assert find_mmproj(beside) is None and find_mmproj(src) is None
    shutil.copy(smollm2_gguf, tmp_path / "llava/smollm2.gguf")  # a text model that the projector does not fit
    assert find_mmproj(tmp_path / "llava/smollm2.gguf") is None
    shutil.copy(mmproj, tmp_path / "llava/other-projector.gguf")
    with pytest.raises(ModelFileError, match="2 vision projectors fit text.gguf"):
        find_mmproj(text)
    with pytest.raises(ModelFileError, match="not a vision projector"):
        plan_model(detect(text), EngineSettings.from_options(mmproj=str(tmp_path / "llava/smollm2.gguf")))


# llava-hf/llava-1.5-7b-hf's config.json: transformers fills in every other value
LLAVA_HF_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
    "projector_hidden_act": "gelu", "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vocab_size": 32064,
}  # fmt: skip


def test_a_sparse_llava_hf_config_gets_transformers_defaults():
    """What llama.cpp's converters see through AutoConfig.to_dict(), we fill in from the same defaults."""
    full = transformers.LlavaConfig(**LLAVA_HF_CONFIG).to_dict()
    hp, text = normalize_hparams(LLAVA_HF_CONFIG), full["text_config"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "head_dim"):  # fmt: skip
        assert hp[key] == text[key], key
    assert hp["rope_parameters"]["rope_theta"] == text["rope_parameters"]["rope_theta"]
    vp = vision_params(LLAVA_HF_CONFIG)
    for key, value in vp["vision"].items():
        assert full["vision_config"][key] == value, key
    assert vp["feature_layers"] == [23]  # of 24 layers: clip.cpp runs 23, as transformers does
    default = transformers.LlavaConfig().to_dict()[
        "vision_config"
    ]  # no vision_config at all: LLaVA 1.5's tower
    assert all(default[k] == v for k, v in vision_params({"model_type": "llava"})["vision"].items())


def test_unconvertible_vision_sides_say_why(layouts, smollm2_hf, tmp_path):
    siglip = {**LLAVA_HF_CONFIG, "vision_config": {"model_type": "siglip_vision_model"}}
    with pytest.raises(UnsupportedFormatError, match="only CLIP converts"):
        vision_params(siglip)
    with pytest.raises(UnsupportedFormatError, match="drops the CLS token"):
        vision_params({**LLAVA_HF_CONFIG, "vision_feature_select_strategy": "full"})
    with pytest.raises(UnsupportedFormatError, match="not a LLaVA checkpoint"):
        hf_to_mmproj(smollm2_hf, tmp_path / "x.gguf")
    broken = _rename(layouts["saved"], tmp_path / NAME, [("multi_modal_projector.linear_2.", "unused.")])
    with pytest.raises(ModelFileError, match="projector tensor 'linear_2.bias' is missing"):
        hf_to_mmproj(broken, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
