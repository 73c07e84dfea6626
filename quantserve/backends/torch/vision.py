"""LLaVA's image side in plain PyTorch: a CLIP vision tower and the projector into the language model's embeddings.

Module and parameter names are the HF checkpoint's (`embeddings.patch_embedding.weight`, `encoder.layers.3.mlp.fc1`,
`linear_1`), so the tensors under `vision_tower.` and `multi_modal_projector.` load verbatim. As in transformers'
LlavaModel.get_image_features: the tower's hidden state after `vision_feature_layer` layers (-2: the one before the
last), without the class token for the "default" strategy, through the projector. Only the layers that feature needs
are run. The tower and projector stay in the checkpoint's float dtype even when the language model is 4-bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.backends.torch.model import empty_embedding
from quantserve.errors import UnsupportedFormatError

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def _activation(name: str, where: str):
    if name not in ACTIVATIONS:
        raise UnsupportedFormatError(
            f"{where} {name!r} is not supported by the torch backend (supported: {', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


@dataclass(frozen=True)
class VisionArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    text_hidden_size: int
    projector_hidden_act: str
    projector_bias: bool
    feature_layers: tuple[int, ...]  # hidden-state indices (0: the embeddings), concatenated
    keep_cls: bool  # vision_feature_select_strategy "full"
    image_token_index: int

    @classmethod
    def from_llava_config(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionArgs:
        """Raises UnsupportedFormatError for vision towers or strategies this module does not implement."""
        v = cfg.get("vision_config") or {}
        if v.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedFormatError(
                f"vision tower {v.get('model_type')!r} is not supported by the torch backend (supported: "
                "clip_vision_model, as in LLaVA 1.5)"
            )
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedFormatError(f"vision_feature_select_strategy {strategy!r} is not supported")
        n_layers = v.get("num_hidden_layers", 24)
        layer = cfg.get("vision_feature_layer", -2)
        layers = tuple(layer if isinstance(layer, list) else [layer])
        args = cls(
            hidden_size=v.get("hidden_size", 1024),
            intermediate_size=v.get("intermediate_size", 4096),
            num_hidden_layers=n_layers,
            num_attention_heads=v.get("num_attention_heads", 16),
            image_size=v.get("image_size", 336),
            patch_size=v.get("patch_size", 14),
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
            hidden_act=v.get("hidden_act", "quick_gelu"),
            text_hidden_size=text_hidden_size,
            projector_hidden_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            feature_layers=tuple(i if i >= 0 else n_layers + 1 + i for i in layers),
            keep_cls=strategy == "full",
            image_token_index=int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))),
        )
        _activation(args.hidden_act, "vision_config.hidden_act")
        _activation(args.projector_hidden_act, "projector_hidden_act")
        if not all(0 <= i <= n_layers for i in args.feature_layers):
            raise UnsupportedFormatError(
                f"vision_feature_layer {layer} is outside the tower's {n_layers} layers"
            )
        return args

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + self.keep_cls


class VisionEmbeddings(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, a.hidden_size, a.patch_size, stride=a.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(a.hidden_size))
        self.position_embedding = empty_embedding(a.num_patches + 1, a.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> [N, 1 + patches, D]: the class token, then the patches row by row."""
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        d, self.n_heads = a.hidden_size, a.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (
            p(x).view(n, t, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class VisionMLP(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.act = _activation(a.hidden_act, "vision_config.hidden_act")
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.self_attn = VisionAttention(a)
        self.layer_norm2 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.mlp = VisionMLP(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(a) for _ in range(a.num_hidden_layers))


class VisionTower(nn.Module):
    """CLIPVisionTransformer (HF names; the misspelt `pre_layrnorm` is CLIP's own)."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.embeddings = VisionEmbeddings(a)
        self.pre_layrnorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.encoder = Encoder(a)
        self.post_layernorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)  # unused by LLaVA's features

    def hidden_states(self, pixels: torch.Tensor, wanted: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states at indices `wanted` (0: after pre_layrnorm, i: after layer i), running no further."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        out = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = out[i] = layer(x)
        return [out[i] for i in wanted]


class Projector(nn.Module):
    """LlavaMultiModalProjector: vision features into the language model's embedding space."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        width = a.hidden_size * len(a.feature_layers)
        self.linear_1 = nn.Linear(width, a.text_hidden_size, bias=a.projector_bias)
        self.act = _activation(a.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(a.text_hidden_size, a.text_hidden_size, bias=a.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """Pixels in, one embedding per image token out."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.vision_tower = VisionTower(a)
        self.multi_modal_projector = Projector(a)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (normalised, quantserve.vision.preprocess) -> [N, tokens_per_image, text hidden]."""
        pixels = pixels.to(self.multi_modal_projector.linear_1.weight.dtype)
        feats = torch.cat(self.vision_tower.hidden_states(pixels, self.args.feature_layers), dim=-1)
        if not self.args.keep_cls:
            feats = feats[:, 1:]
        return self.multi_modal_projector(feats)
