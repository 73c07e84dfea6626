"""A LLaVA checkpoint on the torch backend: where its language model and its vision side live in the files.

A LlavaForConditionalGeneration checkpoint is a Llama-family language model plus a CLIP vision tower and a projector
(quantserve.backends.torch.vision). Checkpoints name them in one of two layouts: llava-hf's (and what transformers
still writes), `language_model.model.*`, `language_model.lm_head.*`, `vision_tower[.vision_model].*`,
`multi_modal_projector.*`; and transformers 5's in-memory one, `model.language_model.*`, `lm_head.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`. Both are renamed here to our modules' names: the language
model's as a plain Llama checkpoint's (`model.layers.0...`, `lm_head.weight`), the rest under `vision_tower.` and
`multi_modal_projector.`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from safetensors import safe_open

from quantserve.backends.torch.vision import LlavaVision, VisionArgs
from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats import ModelSpec

log = logging.getLogger("quantserve.torch")

# (checkpoint prefix, our prefix), longest first where one prefix starts another
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "lm_head."),
)
_TEXT_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json, as a plain checkpoint of it would have it."""
    text = dict(config.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind not in _TEXT_ARCHS:
        raise UnsupportedFormatError(
            f"a LLaVA language model of type {kind!r} is not supported by the torch backend (supported: "
            f"{', '.join(_TEXT_ARCHS)})"
        )
    text.setdefault("architectures", [_TEXT_ARCHS[kind]])
    return text


def rename(name: str) -> str:
    """A LLaVA checkpoint tensor's name in our modules (see the module docstring); other names unchanged."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def is_vision(name: str) -> bool:
    """Whether a renamed tensor belongs to the vision side."""
    return name.startswith(("vision_tower.", "multi_modal_projector."))


def load_vision(spec: ModelSpec, text_hidden: int, dtype: torch.dtype, device: torch.device) -> LlavaVision:
    """The vision tower and projector of a LLaVA checkpoint, dense in `dtype` (never quantized).

    Raises:
        ModelFileError: tensors missing or of the wrong shape.
    """
    args = VisionArgs.from_llava_config(spec.config or {}, text_hidden)
    with torch.device("meta"):
        vision = LlavaVision(args).to(dtype)
    vision = vision.to_empty(device=device)
    params = dict(vision.named_parameters())
    found: dict[str, tuple[Any, str]] = {}
    handles = [safe_open(str(p), framework="pt") for p in spec.files]
    for h in handles:
        for n in h.keys():  # noqa: SIM118 - safe_open has keys()
            found[rename(n)] = (h, n)
    # post_layernorm is in every CLIP checkpoint but LLaVA never uses it; a checkpoint trimmed of it still loads
    optional = {n for n in params if n.startswith("vision_tower.post_layernorm.")}
    missing = [n for n in params if n not in found and n not in optional]
    if missing:
        raise ModelFileError(
            f"the LLaVA checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}; is it a complete "
            "LlavaForConditionalGeneration checkpoint?"
        )
    with torch.no_grad():
        for n, p in params.items():
            if n not in found:
                continue
            h, key = found[n]
            value = h.get_tensor(key)
            if tuple(value.shape) != tuple(p.shape):
                raise ModelFileError(
                    f"tensor {key} has shape {list(value.shape)} but config.json implies {list(p.shape)}; the "
                    "checkpoint and its config do not match"
                )
            p.copy_(value)
    log.info(
        "vision: CLIP %d layers at %d px (%d tokens per image), projector into %d dims",
        args.num_hidden_layers,
        args.image_size,
        args.tokens_per_image,
        text_hidden,
    )
    return vision.eval()
