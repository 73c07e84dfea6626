"""A tiny random-weight LLaVA 1.5 in HF form, built with transformers, the oracle for the vision tests.

No real LLaVA weights can be downloaded here. This one has LLaVA 1.5's shape at a toy size: a CLIP ViT at 336 px with
14 px patches (576 patches, the real count), a two-layer GELU projector, and a small Llama that uses SmolLM2's tokenizer
with `<image>` added, so that prompts tokenize like a real model's. Its processor (LlavaImageProcessor with
pad-to-square, CLIP mean/std) and its chat template are saved beside the weights, as llava-hf's checkpoints are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH = 336, 14
LLAVA_PROCESSOR = {  # llava-hf's preprocessor_config.json
    "image_processor_type": "LlavaImageProcessor",
    "processor_class": "LlavaProcessor",
    "do_pad": True,
    "do_resize": True,
    "size": {"shortest_edge": IMAGE_SIZE},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}
# llava-hf's template, shortened: content parts in order, an image part as <image>.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' or item['type'] == 'image_url' %}"
    "{{ '<image>\n' }}{% elif item['type'] == 'text' %}{{ item['text'] + ' ' }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _random_llava(cfg, seed: int):
    """The LLaVA of `cfg` with random matrices wider than the init's 0.02 std, so that images and tokens change
    the output visibly."""
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


def build_tiny_llava(
    dst: Path,
    smollm2_hf: Path,
    *,
    text_hidden: int = 64,
    text_layers: int = 2,
    text_heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vision_hidden: int = 32,
    vision_layers: int = 3,
    vision_heads: int = 4,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a LlavaForConditionalGeneration checkpoint (config, safetensors, tokenizer, processor) to `dst`."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    dst.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(smollm2_hf / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_token_id = tok.token_to_id(IMAGE_TOKEN)
    tok.save(str(dst / "tokenizer.json"))
    base_cfg = json.loads((smollm2_hf / "config.json").read_text())
    tok_cfg = json.loads((smollm2_hf / "tokenizer_config.json").read_text())
    tok_cfg.setdefault("added_tokens_decoder", {})[str(image_token_id)] = {
        "content": IMAGE_TOKEN, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True,
    }  # fmt: skip
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    for name in ("special_tokens_map.json",):
        if (smollm2_hf / name).exists():
            shutil.copy(smollm2_hf / name, dst / name)

    vocab = image_token_id + 1
    vocab += -vocab % 64  # padded like llava-hf's 32064
    text = LlamaConfig(
        vocab_size=vocab,
        hidden_size=text_hidden,
        intermediate_size=intermediate or text_hidden * 3,
        num_hidden_layers=text_layers,
        num_attention_heads=text_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=base_cfg.get("bos_token_id", 1),
        eos_token_id=base_cfg.get("eos_token_id", 2),
    )
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 4,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=vision_hidden,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
    )
    model = _random_llava(cfg, seed)
    model.to(getattr(torch, dtype)).save_pretrained(dst, safe_serialization=True)
    (dst / "preprocessor_config.json").write_text(json.dumps(LLAVA_PROCESSOR, indent=2))
    (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (dst / "processor_config.json").write_text(
        json.dumps({"processor_class": "LlavaProcessor", "image_token": IMAGE_TOKEN, "patch_size": PATCH,
                    "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}, indent=2)
    )  # fmt: skip
    return dst


def build_tf5_llava(
    dst: Path, smollm2_hf: Path, *, text: str = "llama", image_size: int = 224, seed: int = 1
) -> Path:
    """A tiny LLaVA as transformers 5 saves one with `LlavaProcessor.save_pretrained`: the image processor's
    settings nested in processor_config.json and no preprocessor_config.json; a 224 px CLIP tower with 14 px
    patches (256 image tokens), features from layer -2, the `default` strategy, image mean and std 0.5 (a
    SigLIP-like normalisation, so that CLIP's defaults would be visibly wrong), LlavaImageProcessor's default of
    no padding (shortest edge, then a centre crop), and a `text` (llama or qwen2) language model."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaImageProcessor,
        LlavaProcessor,
        PreTrainedTokenizerFast,
        Qwen2Config,
    )

    dst.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(smollm2_hf / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_token_id = tok.token_to_id(IMAGE_TOKEN)
    base_cfg = json.loads((smollm2_hf / "config.json").read_text())
    vocab = image_token_id + 1
    vocab += -vocab % 64
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=base_cfg.get("bos_token_id", 1),
                  eos_token_id=base_cfg.get("eos_token_id", 2))  # fmt: skip
    text_cfg = LlamaConfig(**common) if text == "llama" else Qwen2Config(**common)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                              image_size=image_size, patch_size=PATCH, projection_dim=32, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5)  # fmt: skip
    n_tokens = (image_size // PATCH) ** 2
    cfg = LlavaConfig(vision_config=vision, text_config=text_cfg, image_token_index=image_token_id,
                      projector_hidden_act="gelu", vision_feature_layer=-2,
                      vision_feature_select_strategy="default", image_seq_length=n_tokens)  # fmt: skip
    _random_llava(cfg, seed).save_pretrained(dst, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    image_processor = LlavaImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    LlavaProcessor(image_processor=image_processor, tokenizer=fast, patch_size=PATCH,
                   vision_feature_select_strategy="default", image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
                   chat_template=CHAT_TEMPLATE).save_pretrained(dst)  # fmt: skip
    assert not (dst / "preprocessor_config.json").exists()  # what this fixture is for
    return dst


def sample_images(seed: int = 0) -> dict[str, bytes]:
    """Odd-sized images in each decoder's format: name -> encoded bytes."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    out = {}
    for name, (w, h), fmt in [
        ("wide.png", (401, 173), "PNG"),
        ("tall.jpg", (97, 333), "JPEG"),
        ("square.webp", (336, 336), "WEBP"),
        ("tiny.gif", (13, 29), "GIF"),
        ("big.png", (1023, 517), "PNG"),
        ("300x180.png", (300, 180), "PNG"),
    ]:
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        arr[: h // 2, : w // 3] = (200, 30, 90)  # a block of colour, so that resizing has edges to keep
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt)
        out[name] = buf.getvalue()
    return out
