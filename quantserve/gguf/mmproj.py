"""LLaVA HF checkpoint -> its vision projector ("mmproj") GGUF, the CLIP tower + MLP projector that libmtmd runs.

llama.cpp converts LLaVA 1.5's vision side only with its legacy scripts (tools/mtmd/legacy-models:
llava_surgery_v2.py, then convert_image_encoder_to_gguf.py --clip-model-is-vision --llava-projector; its
convert_hf_to_gguf.py --mmproj takes pixtral-style LLaVAs only). This writes what that pair writes, byte for byte:
the same keys in the same order, the same tensor names, order and types (tests/gguf/test_convert_llava.py runs them).
The one choice the recipe leaves open, `clip.vision.feature_layer`, is always written: without it clip.cpp runs one
ViT layer fewer than `vision_feature_layer` asks for (llama.cpp issue #25817).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from quantserve.errors import ConfigError, ModelFileError, UnsupportedFormatError
from quantserve.formats import ModelSpec, detect
from quantserve.formats.hf_config import is_llava
from quantserve.formats.image_processor import ImageProcessorConfig, check_tower
from quantserve.formats.staging import check_destination, ensure_free_space, staged_output
from quantserve.gguf.safetensors_source import SafetensorsSource
from quantserve.gguf.writer import OutTensor

MMPROJ_TYPES = {"f32": 0, "f16": 1}  # general.file_type, as convert_image_encoder_to_gguf.py numbers them
# transformers' CLIPVisionConfig and LlavaConfig defaults: a config.json leaves out what equals them
_CLIP_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "projection_dim": 512, "num_hidden_layers": 12,
    "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5, "model_type": "clip_vision_model",
}  # fmt: skip
_LLAVA_VISION = {  # LlavaConfig's vision tower when config.json has no vision_config: LLaVA 1.5's CLIP ViT-L/14-336
    **_CLIP_DEFAULTS, "hidden_size": 1024, "intermediate_size": 4096, "projection_dim": 768,
    "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
}  # fmt: skip
_LLAVA_DEFAULTS = {
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
}  # fmt: skip

# Where checkpoints keep the CLIP tower (llava-hf: vision_tower.vision_model.*; transformers 5 saves vision_tower.*)
_TOWER_PREFIXES = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# In the order of transformers' CLIPVisionModel.state_dict(), which the legacy script writes; fc1/fc2 keep its
# swapped names ffn_down/ffn_up, which clip.cpp swaps back (`is_ffn_swapped`).
_EMBEDDINGS = (
    ("embeddings.class_embedding", "v.class_embd"),
    ("embeddings.patch_embedding.weight", "v.patch_embd.weight"),
    ("embeddings.position_embedding.weight", "v.position_embd.weight"),
    ("pre_layrnorm.weight", "v.pre_ln.weight"),
    ("pre_layrnorm.bias", "v.pre_ln.bias"),
)
_LAYER = (
    ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"), ("self_attn.q_proj", "attn_q"),
    ("self_attn.out_proj", "attn_out"), ("layer_norm1", "ln1"), ("mlp.fc1", "ffn_down"), ("mlp.fc2", "ffn_up"),
    ("layer_norm2", "ln2"),
)  # fmt: skip
_PROJECTOR = (("linear_1", "mm.0"), ("linear_2", "mm.2"))  # llava.projector's names sort linear_1 first


def vision_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A LLaVA config.json's vision settings with transformers' defaults filled in.

    Raises:
        UnsupportedFormatError: a vision tower or projector clip.cpp's "mlp" projector type cannot run.
    """
    given = config.get("vision_config")
    vision = {**_CLIP_DEFAULTS, **given} if isinstance(given, dict) else dict(_LLAVA_VISION)
    hp = {**_LLAVA_DEFAULTS, **{k: v for k, v in config.items() if k in _LLAVA_DEFAULTS}, "vision": vision}
    problems = []
    if vision["model_type"] != "clip_vision_model":
        problems.append(f"its vision tower is {vision['model_type']!r} (only CLIP converts)")
    if vision["hidden_act"] not in ("quick_gelu", "gelu"):
        problems.append(
            f"the tower's hidden_act is {vision['hidden_act']!r} (clip.cpp runs quick_gelu or gelu)"
        )
    if hp["projector_hidden_act"] != "gelu" or not hp["multimodal_projector_bias"]:
        problems.append("the projector is not linear+bias, GELU, linear+bias (clip.cpp's 'mlp' projector)")
    if hp["vision_feature_select_strategy"] != "default":
        problems.append("vision_feature_select_strategy is not 'default' (clip.cpp drops the CLS token)")
    if problems:
        raise UnsupportedFormatError(
            f"this LLaVA cannot be converted to an mmproj GGUF: {'; '.join(problems)}"
        )
    layers = hp["vision_feature_layer"]
    n = vision["num_hidden_layers"]
    # convert_image_encoder_to_gguf.py: hidden-state indices made non-negative (0 is the tower's input)
    hp["feature_layers"] = [
        i if i >= 0 else n + i + 1 for i in ([layers] if isinstance(layers, int) else layers)
    ]
    return hp


def _preprocessor(directory: Path, vision: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """The image mean and std, read as transformers reads them; a processor whose images the tower cannot take
    is refused here, as the torch backend refuses it at load."""
    cfg = ImageProcessorConfig.from_dir(directory)
    check_tower(cfg, dict(vision))
    return [float(x) for x in cfg.image_mean], [float(x) for x in cfg.image_std]  # FLOAT32 arrays


def _strip(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((name[len(p) :] for p in prefixes if name.startswith(p)), None)


def _read(source: SafetensorsSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return source.read(name).reshape(shape)


def _tensor_type(name: str, shape: tuple[int, ...], in_projector: bool, mmproj_type: str) -> T:
    """convert_image_encoder_to_gguf.py's rule: the patch-embedding kernel and the projector's matrices are F16 even
    in an f32 file; at f16 every other 2-D `.weight` is F16 too; the rest is F32."""
    if len(shape) == 4 or (in_projector and len(shape) == 2):
        return T.F16
    if mmproj_type == "f16" and len(shape) == 2 and name.endswith(".weight"):
        return T.F16
    return T.F32


def plan_mmproj(
    source: SafetensorsSource, hp: Mapping[str, Any], mmproj_type: str, directory: Path
) -> list[OutTensor]:
    """The mmproj's tensors: projector first, then the tower up to the deepest feature layer.

    Raises:
        ModelFileError: a tower or projector tensor is missing.
    """
    tower = {s: n for n in source.tensors if (s := _strip(n, _TOWER_PREFIXES)) is not None}
    projector = {s: n for n in source.tensors if (s := _strip(n, _PROJECTOR_PREFIXES)) is not None}
    wanted = [(f"{hf}.{p}", f"{gg}.{p}", projector) for hf, gg in _PROJECTOR for p in ("bias", "weight")]
    wanted += [(hf, gg, tower) for hf, gg in _EMBEDDINGS]
    for i in range(max(hp["feature_layers"])):
        wanted += [(f"encoder.layers.{i}.{hf}.{p}", f"v.blk.{i}.{gg}.{p}", tower)
                   for hf, gg in _LAYER for p in ("weight", "bias")]  # fmt: skip
    out = []
    for local, name, table in wanted:
        if local not in table:
            kind = "projector" if table is projector else "vision tower"
            raise ModelFileError(
                f"{directory}: the LLaVA {kind} tensor '{local}' is missing; the checkpoint is incomplete or "
                "not in a LLaVA 1.5 layout"
            )
        t = source.tensors[table[local]]
        shape = tuple(d for d in t.shape if d != 1)  # the script squeezes every tensor
        qtype = _tensor_type(name, shape, table is projector, mmproj_type)
        out.append(
            OutTensor(name, tuple(reversed(shape)), qtype, partial(_read, source, table[local], shape))
        )
    return out


def _add_keys(
    writer: gguf.GGUFWriter, name: str, hp: Mapping[str, Any], mmproj_type: str, model_dir: Path
) -> None:
    """The KV pairs, in convert_image_encoder_to_gguf.py's order (a LLaVA projector, no text encoder)."""
    v = hp["vision"]
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_file_type(MMPROJ_TYPES[mmproj_type])
    writer.add_name(name)
    writer.add_description("image encoder for LLaVA")
    writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.image_size", v["image_size"])
    writer.add_uint32("clip.vision.patch_size", v["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", v["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", v["intermediate_size"])
    writer.add_uint32("clip.vision.projection_dim", v["projection_dim"])
    writer.add_uint32("clip.vision.attention.head_count", v["num_attention_heads"])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", v["layer_norm_eps"])
    writer.add_uint32("clip.vision.block_count", max(hp["feature_layers"]))
    writer.add_array("clip.vision.feature_layer", hp["feature_layers"])
    mean, std = _preprocessor(model_dir, v)
    writer.add_array("clip.vision.image_mean", mean)
    writer.add_array("clip.vision.image_std", std)
    writer.add_bool("clip.use_gelu", v["hidden_act"] == "gelu")


def _llava(src: Path) -> tuple[ModelSpec, dict[str, Any]]:
    spec = detect(src)
    if spec.format != "safetensors" or not is_llava(spec.config):
        raise UnsupportedFormatError(
            f"{src} is not a LLaVA checkpoint (config.json architectures LlavaForConditionalGeneration, "
            "dense safetensors); only a LLaVA's vision side becomes an mmproj GGUF"
        )
    return spec, vision_params(spec.config or {})


def mmproj_file_name(src: Path, mmproj_type: str = "f16") -> str:
    """llama.cpp's default name for a model's projector: convert_hf_to_gguf.py --mmproj's `mmproj-<Name>-F16.gguf`
    (the name heuristics see the projector's own parameter count, as there)."""
    spec, hp = _llava(Path(src))
    tensors = plan_mmproj(SafetensorsSource(spec), hp, "f32", spec.directory)
    meta = gguf.Metadata.load(None, spec.directory, None, sum(math.prod(t.ne) for t in tensors))
    name = meta.name or spec.directory.resolve().name
    base = gguf.naming_convention(name, meta.basename, meta.finetune, meta.version, None, mmproj_type.upper())
    return f"mmproj-{base}.gguf"


def hf_to_mmproj(src: Path, dst: Path, mmproj_type: str = "f16", force: bool = False) -> Path:
    """Write the vision projector GGUF of a LLaVA checkpoint (llava-hf or transformers 5 tensor names).

    Args:
        src: the LLaVA directory (config.json with a vision_config, *.safetensors, its image processor's file).
        dst: the .gguf file to create; the image processor's file is copied beside it.
        mmproj_type: "f16" (what llama.cpp ships) or "f32".
        force: replace an existing dst.
    Returns:
        dst.
    Raises:
        ConfigError: an unknown mmproj_type, or dst exists without force.
        UnsupportedFormatError: not a LLaVA checkpoint, or a vision side clip.cpp cannot run.
        ModelFileError: a missing tensor or a malformed file.
    """
    src, dst = Path(src), Path(dst)
    if mmproj_type not in MMPROJ_TYPES:
        raise ConfigError(f"mmproj type {mmproj_type!r} is not supported; choose f16 (llama.cpp's) or f32")
    spec, hp = _llava(src)
    check_destination(dst, force)
    tensors = plan_mmproj(SafetensorsSource(spec), hp, mmproj_type, spec.directory)
    ensure_free_space(dst.parent, sum(t.n_bytes for t in tensors), f"writing the mmproj of {src.name}")
    writer = gguf.GGUFWriter(path=None, arch="clip")
    for t in tensors:
        writer.add_tensor_info(
            t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype
        )
    # general.name as the legacy recipe sets it: the vision directory's name, i.e. the checkpoint's
    _add_keys(writer, spec.directory.resolve().name, hp, mmproj_type, spec.directory)
    with staged_output(dst, directory=False, force=force) as tmp:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(gguf.quants.quantize(t.load(), t.qtype))
        writer.close()
    copy_processor_settings(spec.directory, dst.parent, force)
    return dst


def copy_processor_settings(src: Path, dst_dir: Path, force: bool) -> None:
    """The checkpoint's image-processor file(s) beside the mmproj, where the llama.cpp backend reads them to crop
    images as the checkpoint does (libmtmd pads instead; backends/llamacpp/vision.py). The mmproj itself stays
    byte for byte llama.cpp's. An existing file of the same name stays unless `force`."""
    import shutil

    for name in ("processor_config.json", "preprocessor_config.json"):
        here, there = Path(src) / name, Path(dst_dir) / name
        if here.is_file() and here.resolve() != there.resolve() and (force or not there.exists()):
            shutil.copyfile(here, there)
