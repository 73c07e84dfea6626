"""LLaVA 1.5's image preprocessing: RGB pixels -> the vision tower's pixel_values [3, H, W] float32.

Step for step what transformers' LlavaImageProcessor (PIL backend; CLIPImageProcessor when do_pad is false) does,
including its dtypes, so that our pixel_values equal the oracle's: pad to square with the mean colour, resize the
shortest edge with PIL, centre crop, rescale in float64 then cast, normalise in float32.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image as PILImage

from quantserve.core.multimodal import Image
from quantserve.formats.image_processor import ImageProcessorConfig


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


def geometry(rgb: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """The processor's geometric steps on RGB uint8 [H, W, 3]: pad to square (if do_pad), resize, centre crop.
    Still uint8: what the llama.cpp backend hands libmtmd, whose own resize is then a copy (same size) and whose
    normalisation is the only step left to it (backends/llamacpp/vision.py)."""
    x = rgb
    if cfg.do_pad:
        # LlavaImageProcessor's fill: int(mean * 255) per channel, truncated, in the image's uint8.
        x = pad_to_square(x, tuple(int(m * 255) for m in cfg.image_mean))
    if cfg.do_resize:
        h, w = resize_size(x.shape[0], x.shape[1], cfg)
        x = np.asarray(PILImage.fromarray(x).resize((w, h), resample=cfg.resample))
    if cfg.do_center_crop:
        x = center_crop(x, cfg.crop_size)
    return x


def pixel_values(image: Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """The vision tower's input for one image: float32 [3, H, W] (H, W = crop_size after a centre crop).

    Equal (to float32 rounding, in practice bit for bit) to transformers' LlavaImageProcessor on the same file.
    """
    x = geometry(image.rgb, cfg)  # [H, W, 3] uint8
    if cfg.do_rescale:  # transformers' rescale: multiply in float64, then cast to float32
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32, copy=False)
    if cfg.do_normalize:  # in float32, mean and std cast to float32 first, as transformers' normalize
        x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))  # [3, H, W]
