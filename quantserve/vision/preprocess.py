"""LLaVA 1.5's image preprocessing: RGB pixels -> the vision tower's pixel_values [3, H, W] float32.

Step for step what transformers' LlavaImageProcessor (PIL backend; CLIPImageProcessor when do_pad is false) does,
including its dtypes, so that our pixel_values equal the oracle's: pad to square with the mean colour, resize the
shortest edge with PIL, centre crop, rescale in float64 then cast, normalise in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image as PILImage

from quantserve.core.multimodal import Image
from quantserve.errors import ModelFileError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json, with llava-hf/llava-1.5-7b-hf's values where a key is missing.

    `size` is either {"shortest_edge": n} (-> shortest_edge) or {"height", "width"} (-> resize_to, exact).
    do_pad defaults to False as in transformers' LlavaImageProcessor; llava-hf's LLaVA 1.5 configs that want the
    original repo's pad-to-square say "do_pad": true. do_convert_rgb is kept for completeness: an Image's pixels are
    always RGB already (quantserve.vision.images.to_rgb, the same conversion).
    """

    do_resize: bool = True
    shortest_edge: int | None = 336
    resize_to: tuple[int, int] | None = None  # (height, width)
    resample: int = PILImage.Resampling.BICUBIC
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (336, 336)  # (height, width)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_pad: bool = False
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], *, source: str = "preprocessor_config.json"
    ) -> ImageProcessorConfig:
        """Parse the JSON object; unknown keys are ignored, as transformers does."""
        known = {f.name for f in fields(cls)} - {"shortest_edge", "resize_to", "crop_size"}
        kw: dict[str, Any] = {k: d[k] for k in known if k in d}
        try:
            for k in ("image_mean", "image_std"):
                if k in kw:
                    v = kw[k]
                    kw[k] = tuple(float(x) for x in v) if isinstance(v, list) else (float(v),) * 3
            if (
                "size" in d
            ):  # an int is the shortest edge (old CLIP configs, like transformers' get_size_dict)
                size = d["size"] if isinstance(d["size"], dict) else {"shortest_edge": d["size"]}
                if "shortest_edge" in size and "longest_edge" not in size:
                    kw["shortest_edge"] = int(size["shortest_edge"])
                elif {"height", "width"} <= size.keys():
                    kw["shortest_edge"], kw["resize_to"] = None, (int(size["height"]), int(size["width"]))
                else:
                    raise ValueError(f"size {size} (supported: shortest_edge, or height and width)")
            if "crop_size" in d:
                c = d["crop_size"]
                kw["crop_size"] = (
                    (int(c["height"]), int(c["width"])) if isinstance(c, dict) else (int(c), int(c))
                )
            cfg = cls(**kw)
        except (TypeError, ValueError, KeyError) as e:
            raise ModelFileError(f"{source}: cannot read the image processor settings: {e}") from None
        if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
            raise ModelFileError(f"{source}: image_mean and image_std need 3 values (RGB)")
        return cfg

    @classmethod
    def from_dir(cls, model_dir: Path) -> ImageProcessorConfig:
        """Read `model_dir/preprocessor_config.json`; all defaults if there is none."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            return cls()
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{path}: not readable JSON ({e})") from None
        if not isinstance(d, dict):
            raise ModelFileError(f"{path}: expected a JSON object")
        return cls.from_dict(d, source=str(path))


def pad_to_square(rgb: np.ndarray, fill: tuple[int, int, int]) -> np.ndarray:
    """[H, W, 3] uint8 -> [S, S, 3], S = max(H, W), the image centred (offset rounded down) on `fill`."""
    h, w, _ = rgb.shape
    if h == w:
        return rgb
    s = max(h, w)
    out = np.empty((s, s, 3), dtype=rgb.dtype)
    out[:] = np.asarray(fill, dtype=rgb.dtype)
    top, left = (s - h) // 2, (s - w) // 2
    out[top : top + h, left : left + w] = rgb
    return out


def resize_size(h: int, w: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) after resizing: the shortest edge to `shortest_edge`, the other truncated (not rounded)."""
    if cfg.resize_to is not None:
        return cfg.resize_to
    assert cfg.shortest_edge is not None
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
    return (new_long, new_short) if w <= h else (new_short, new_long)


def center_crop(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[H, W, C] -> [ch, cw, C]: offsets (H - ch) // 2, (W - cw) // 2; zero-padded where the image is smaller."""
    h, w = x.shape[:2]
    ch, cw = size
    if h < ch or w < cw:  # transformers pads with zeros first, the image offset rounded up
        ph, pw = max(ch, h), max(cw, w)
        top_pad, left_pad = math.ceil((ph - h) / 2), math.ceil((pw - w) / 2)
        padded = np.zeros((ph, pw, *x.shape[2:]), dtype=x.dtype)
        padded[top_pad : top_pad + h, left_pad : left_pad + w] = x
        top, left = (h - ch) // 2 + top_pad, (w - cw) // 2 + left_pad
        return padded[max(0, top) : min(ph, top + ch), max(0, left) : min(pw, left + cw)]
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[top : top + ch, left : left + cw]


def pixel_values(image: Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """The vision tower's input for one image: float32 [3, H, W] (H, W = crop_size after a centre crop).

    Equal (to float32 rounding, in practice bit for bit) to transformers' LlavaImageProcessor on the same file.
    """
    x = image.rgb  # [H, W, 3] uint8
    if cfg.do_pad:
        # LlavaImageProcessor's fill: int(mean * 255) per channel, truncated, in the image's uint8.
        x = pad_to_square(x, tuple(int(m * 255) for m in cfg.image_mean))
    if cfg.do_resize:
        h, w = resize_size(x.shape[0], x.shape[1], cfg)
        x = np.asarray(PILImage.fromarray(x).resize((w, h), resample=cfg.resample))
    if cfg.do_center_crop:
        x = center_crop(x, cfg.crop_size)
    if cfg.do_rescale:  # transformers' rescale: multiply in float64, then cast to float32
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32, copy=False)
    if cfg.do_normalize:  # in float32, mean and std cast to float32 first, as transformers' normalize
        x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))  # [3, H, W]
