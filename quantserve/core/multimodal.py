"""Images in a prompt, as the engine and both backends see them.

An image arrives as an encoded file (PNG, JPEG, WebP, GIF), checked and decoded once at the HTTP boundary
(quantserve.vision.images). In the prompt it becomes a run of image tokens, as many as the vision encoder
produces embeddings for it; an `ImageSpan` says where that run sits. The backends replace the run's embeddings with
the image's (torch) or evaluate the image in its place (llama.cpp's libmtmd).

The image tokens are the same for every image, so the KV prefix caches key each image by `digest`, a hash of
its bytes: two prompts with the same text and different images never share the image's KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class Image:
    """One decoded image: its file bytes, its RGB pixels [H, W, 3] uint8, and a digest of the bytes."""

    data: bytes
    rgb: np.ndarray
    digest: bytes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", hashlib.sha256(self.data).digest())

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.rgb.shape[1], self.rgb.shape[0]


@dataclass(frozen=True)
class ImageSpan:
    """An image at prompt tokens [offset, offset + length)."""

    offset: int
    length: int
    image: Image

    @property
    def end(self) -> int:
        return self.offset + self.length


def expand_images(
    tokens: list[int], image_token: int, images: list[Image], tokens_per_image: int
) -> tuple[list[int], list[ImageSpan]]:
    """The prompt with each `image_token` repeated `tokens_per_image` times, and where each image went.

    The i-th image token is the i-th image. The caller checks beforehand that the counts agree."""
    out: list[int] = []
    spans: list[ImageSpan] = []
    it = iter(images)
    for t in tokens:
        if t == image_token:
            spans.append(ImageSpan(len(out), tokens_per_image, next(it)))
            out.extend([image_token] * tokens_per_image)
        else:
            out.append(t)
    return out, spans


def block_extra_keys(spans: list[ImageSpan], start: int, stop: int) -> tuple[bytes, ...]:
    """The digests of the images that overlap tokens [start, stop): what a KV block's hash adds to its tokens."""
    return tuple(s.image.digest for s in spans if s.offset < stop and s.end > start)
