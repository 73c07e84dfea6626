"""Image inputs for vision-language models: checked decoding, SSRF-safe URL fetching, LLaVA preprocessing."""

from __future__ import annotations

from quantserve.vision.fetch import MediaPolicy, fetch_image, load_image
from quantserve.vision.images import ImageLimits, check_image_count, decode_image, parse_data_uri
from quantserve.vision.preprocess import ImageProcessorConfig, pixel_values

__all__ = [
    "ImageLimits",
    "ImageProcessorConfig",
    "MediaPolicy",
    "check_image_count",
    "decode_image",
    "fetch_image",
    "load_image",
    "parse_data_uri",
    "pixel_values",
]
