"""HF model directories: read JSON configs and find the quantization config in the order vLLM uses
(docs/quantized-checkpoints.md, "Where the quantization config is found")."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError

# What a model directory holds besides weights and config.json; copied into every directory derived from it.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFileError(f"{path}: cannot parse JSON ({e}); fix or re-download the file") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def find_chat_template(directory: Path) -> tuple[str, Path] | None:
    """An HF checkpoint's chat template and the file it is in: tokenizer_config.json's `chat_template`, else
    chat_template.jinja, else chat_template.json (newer transformers save it apart). A list of named templates
    gives the one named "default", as llama.cpp's GGUF keeps. None: the checkpoint has none.

    Raises:
        ModelFileError: one of those files is not a JSON object.
    """
    for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".jinja"):
            template: Any = path.read_text(encoding="utf-8")
        else:
            template = read_json_object(path).get("chat_template")
        if isinstance(template, list):
            template = next(
                (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                None,
            )
        if isinstance(template, str) and template:
            return template, path
    return None


def find_quant_config(
    config: dict[str, Any] | None, directory: Path, st_metadata: Mapping[str, str]
) -> tuple[dict[str, Any] | None, str]:
    """The quantization config and where it was found, in the order of docs/quantized-checkpoints.md,
    "Where the quantization config is found"."""
    config = config or {}
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    cfg = directory / "config.json"
    for where, qc in (
        (f"{cfg} quantization_config", config.get("quantization_config")),
        (f"{cfg} text_config.quantization_config", text_config.get("quantization_config")),
        (f"{cfg} compression_config", config.get("compression_config")),
    ):
        if qc is not None:
            if not isinstance(qc, dict):
                raise ModelFileError(f"{where} is {type(qc).__name__}, expected an object")
            return qc, where
    for name in ("quantize_config.json", "quant_config.json"):
        if (directory / name).is_file():
            return read_json_object(directory / name), str(directory / name)
    if "gptq_bits" in st_metadata:
        # AutoGPTQ writes its settings as safetensors __metadata__ strings
        def flag(key: str) -> bool:
            return st_metadata.get(key, "false").lower() == "true"

        qc = {
            "quant_method": st_metadata.get("gptq_quant_method", "gptq"),
            "bits": st_metadata["gptq_bits"],
            "group_size": st_metadata.get("gptq_group_size", "-1"),
            "desc_act": flag("gptq_desc_act"),
            "checkpoint_format": st_metadata.get("gptq_checkpoint_format", "gptq"),
        }
        return qc, f"{directory} safetensors __metadata__ gptq_* keys"
    return None, ""


def quant_method_of(qc: dict[str, Any]) -> str:
    method = qc.get("quant_method") or qc.get("method")
    if method is None:
        # old quantize_config.json (AutoGPTQ) and quant_config.json (AutoAWQ) carry no quant_method
        if "w_bit" in qc:
            return "awq"
        if "config_groups" in qc:
            return "compressed-tensors"
        if "bits" in qc:
            return "gptq"
        return ""
    return str(method).lower()


def is_llava(config: Mapping[str, Any] | None) -> bool:
    """A LLaVA 1.5-style checkpoint (LlavaForConditionalGeneration): a language model, a CLIP vision tower and a
    projector in one directory, told apart from text models by config.json alone."""
    if not config:
        return False
    archs = config.get("architectures")
    first = archs[0] if isinstance(archs, list) and archs else None
    return config.get("model_type") == "llava" or first == "LlavaForConditionalGeneration"


def image_processor_settings(directory: Path) -> tuple[dict[str, Any], str] | None:
    """A vision checkpoint's image-processor settings, found where transformers (5.x, `ImageProcessingMixin.
    get_image_processor_dict`) finds them: the "image_processor" object nested in `processor_config.json` first
    (what `LlavaProcessor.save_pretrained` writes since transformers 5), else `preprocessor_config.json` (older
    checkpoints, llava-hf's). Returns (settings, where they came from), or None when the directory has neither.

    Raises:
        ModelFileError: a file that is not a JSON object, or a nested entry that is not one.
    """
    directory = Path(directory)
    nested = directory / "processor_config.json"
    if nested.is_file():
        processor = read_json_object(nested)
        if "image_processor" in processor:
            settings = processor["image_processor"]
            if not isinstance(settings, dict):
                raise ModelFileError(f"{nested}: 'image_processor' is not a JSON object")
            return settings, f"{nested} (image_processor)"
    flat = directory / "preprocessor_config.json"
    if flat.is_file():
        return read_json_object(flat), str(flat)
    return None


# transformers' Gemma2Config / Gemma3TextConfig defaults for the keys a released config may leave out (Gemma 3's
# multimodal configs give little more than the sizes that differ); rope per layer type is read where it is used
_GEMMA_COMMON = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                     sliding_window=4096, query_pre_attn_scalar=256, tie_word_embeddings=True)  # fmt: skip
GEMMA_DEFAULTS = {
    "gemma2": {**_GEMMA_COMMON, "max_position_embeddings": 8192, "rope_theta": 10000.0,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_GEMMA_COMMON, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0},
}  # fmt: skip


# Families whose layers attend within `sliding_window` tokens, as transformers builds their masks: the architecture
# -> (the window when config.json leaves the key out, how often a layer is global instead: 0 never). Gemma's
# configs since transformers 4.53 list each layer's type; older ones have a pattern (Gemma 2 alternates, Gemma 3
# has five windowed layers to one global).
_WINDOWED = {
    "MistralForCausalLM": (4096, 0), "MixtralForCausalLM": (0, 0), "Phi3ForCausalLM": (0, 0),
    "Gemma2ForCausalLM": (4096, 2), "Gemma3ForCausalLM": (4096, 6), "GptOssForCausalLM": (128, 2),
}  # fmt: skip
# those whose layers alternate (layer_types, or the pattern): gpt-oss's windowed layers come first, as Gemma's
_PER_LAYER = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")
# Multimodal checkpoints whose language model the torch backend runs alone (text in, text out): the wrapper's
# architecture -> its language model's (its config.json's text_config)
WRAPPERS = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",  # how Qwen3.5 and 3.6 are released
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def layer_windows(config: Mapping[str, Any]) -> tuple[int, ...]:
    """Each decoder layer's window (0: it attends to every position), or () for a model without windows.

    Raises:
        ValueError: `layer_types` that do not name sliding_attention or full_attention for each layer.
    """
    archs = config.get("architectures") or []
    first = archs[0] if isinstance(archs, list) and archs else None
    if first in WRAPPERS:
        config, first = config.get("text_config") or {}, WRAPPERS[first]
    if first not in _WINDOWED:
        return ()
    default, every = _WINDOWED[first]
    n = int(config.get("num_hidden_layers") or 26)
    if first not in _PER_LAYER:
        window = int(config.get("sliding_window", default) or 0)
        return (window,) * n if window else ()
    window = int(config.get("sliding_window") or default)  # Gemma's configs mean the default by null too
    types = config.get("layer_types")
    if types is None:
        every = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or every
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"config.json's layer_types {types!r} does not name sliding_attention or full_attention for each of "
            f"its {n} layers"
        )
    return tuple(window if t == "sliding_attention" else 0 for t in types)
