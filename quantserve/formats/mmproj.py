"""Vision projector ("mmproj") GGUFs: tell one from its metadata, and find the one beside a text GGUF.

A LLaVA served by llama.cpp is two files: the language model and the projector libmtmd loads (clip.cpp). Both
kinds of projector file are recognised: llama.cpp's legacy LLaVA converter writes `general.architecture = "clip"`,
convert_hf_to_gguf.py --mmproj adds `general.type = "mmproj"`; both set `clip.has_vision_encoder`. A projector is
paired with a model by its output width, never by file name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from quantserve.errors import ModelFileError
from quantserve.formats import sniff
from quantserve.formats.gguf import read_gguf_info
from quantserve.formats.spec import GGUFInfo

_LLAVA_PROJ = re.compile(r"^mm\.(\d+)\.weight$")  # clip.cpp TN_LLAVA_PROJ


def is_mmproj(info: GGUFInfo) -> bool:
    """A vision projector file (not a model)."""
    kind = info.get("general.type") == "mmproj" or info.get("general.architecture") == "clip"
    return kind and bool(info.get("clip.has_vision_encoder"))


def projector_width(info: GGUFInfo) -> int | None:
    """The embedding width the projector feeds the language model (its last matrix's rows), if it can be told."""
    if info.get("general.type") == "mmproj":  # convert_hf_to_gguf.py writes the text model's width here
        width = info.get("clip.vision.projection_dim")
        return width if isinstance(width, int) else None
    layers = [(int(m[1]), t) for t in info.tensors if (m := _LLAVA_PROJ.match(t.name)) and len(t.shape) == 2]
    return max(layers, key=lambda lt: lt[0])[1].shape[1] if layers else None  # ne[1]: the output rows


def describe_mmproj(info: GGUFInfo) -> str:
    """One line for `quantserve inspect`: the tower and the projector."""
    blocks, size = info.get("clip.vision.block_count"), info.get("clip.vision.image_size")
    patch, proj = info.get("clip.vision.patch_size"), info.get("clip.projector_type") or "?"
    return (
        f"{blocks}-block ViT, {size} px images in {patch} px patches, '{proj}' projector to width "
        f"{projector_width(info) or '?'}"
    )


def find_mmproj(model: str | os.PathLike[str]) -> Path | None:
    """The vision projector for a GGUF model: the one GGUF beside it (in it, for a directory) that is a projector
    and whose output width is the model's embedding length.

    Returns:
        its path, or None when there is none (a text-only model, or `model` is not a GGUF).
    Raises:
        ModelFileError: several fit; the message names them and how to choose.
    """
    model = Path(model)
    directory = model if model.is_dir() else model.parent
    ggufs = sorted(p for p in directory.iterdir() if p.is_file() and sniff.classify_file(p) == sniff.GGUF)
    infos = []
    for p in ggufs:
        try:
            infos.append(read_gguf_info(p))
        except ModelFileError:
            # a broken neighbour (a partial download) is no projector; the model itself reports its own errors
            if p.name == model.name:
                raise
    if model.is_dir():
        texts = [i for i in infos if not is_mmproj(i) and i.get("general.architecture")]
    else:
        texts = [i for i in infos if i.path.name == model.name]
    if not texts or is_mmproj(texts[0]):
        return None  # not a GGUF model (a safetensors directory, or a projector itself)
    width = texts[0].get(f"{texts[0].get('general.architecture')}.embedding_length")
    fits = [i.path for i in infos if is_mmproj(i) and projector_width(i) in (width, None)]
    if len(fits) > 1:
        raise ModelFileError(
            f"{directory}: {len(fits)} vision projectors fit {model.name} ({', '.join(p.name for p in fits)}); "
            'name one in models.toml (mmproj = "FILE.gguf") or keep one beside the model'
        )
    return fits[0] if fits else None
