"""Check and decode one image from a request: data: URIs and encoded bytes -> `quantserve.core.multimodal.Image`.

Everything here parses untrusted bytes, so every limit (bytes, pixels) is checked before the work it bounds, and
every failure is an InvalidRequestError naming the request field, the numbers and the fix (never a 500).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin
from PIL import Image as PILImage

from quantserve.core.multimodal import Image
from quantserve.errors import InvalidRequestError

MIB = 1 << 20
ACCEPTED = "PNG, JPEG, WebP or GIF"


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send. The server's --max-image-bytes, --max-images and --max-image-pixels."""

    max_bytes: int = 20 * MIB  # per encoded image
    max_images: int = 8  # per request
    max_pixels: int = (
        4096 * 4096
    )  # width x height: a bomb is small on the wire, huge in memory (3 bytes a pixel)


def format_bytes(n: int | float) -> str:
    """1.5 MiB, 12 KiB, 300 bytes."""
    if n >= MIB:
        return f"{n / MIB:.1f}".removesuffix(".0") + " MiB"
    if n >= 1024:
        return f"{n / 1024:.1f}".removesuffix(".0") + " KiB"
    return f"{int(n)} bytes"


def _mp(pixels: int) -> str:
    """Megapixels, shortly: 400, 40, 0.25."""
    mp = pixels / 1e6
    return f"{mp:.0f}" if mp >= 100 else f"{mp:.3g}"


def too_big(where: str, size: str, limits: ImageLimits) -> InvalidRequestError:
    """The error for an image of `size` (already formatted, e.g. "25.3 MiB" or "more than 20 MiB")."""
    return InvalidRequestError(
        f"{where!r} is {size}; the limit is {format_bytes(limits.max_bytes)} per image (--max-image-bytes); "
        "send a smaller or more compressed image",
        param=where,
    )


def check_image_bytes(n: int, limits: ImageLimits, where: str) -> None:
    """Raise InvalidRequestError if an encoded image of `n` bytes is over `limits.max_bytes`."""
    if n > limits.max_bytes:
        size = format_bytes(n)
        raise too_big(where, f"more than {size}" if size == format_bytes(limits.max_bytes) else size, limits)


def check_image_count(n: int, limits: ImageLimits, where: str) -> None:
    """Raise InvalidRequestError if a request carries more than `limits.max_images` images."""
    if n > limits.max_images:
        raise InvalidRequestError(
            f"{where!r} has {n} images; the limit is {limits.max_images} per request (--max-images)",
            param=where,
        )


def parse_data_uri(url: str, limits: ImageLimits, where: str) -> bytes:
    """The bytes of a `data:image/<type>;base64,<payload>` URI.

    The decoded size is estimated from the payload's length and checked before anything is decoded or copied.
    The media type only has to be image/*: decode_image trusts the bytes' magic, not the label.

    Raises:
        InvalidRequestError: not a data: URI, not base64, not an image type, invalid base64, or too big.
    """
    fix = "send data:image/png;base64,<the file's bytes in base64>"
    if url[:5].lower() != "data:":
        raise InvalidRequestError(f"{where!r} is not a data: URI; {fix}", param=where)
    comma = url.find(",", 0, 256)  # the header is short; never scan a huge payload for it
    if comma < 0:
        raise InvalidRequestError(
            f"{where!r} is a data: URI without a ',' after its header; {fix}", param=where
        )
    media_type, *params = (p.strip().lower() for p in url[5:comma].split(";"))
    if not params or params[-1] != "base64":
        raise InvalidRequestError(f"{where!r} is a data: URI that is not base64-encoded; {fix}", param=where)
    if not media_type.startswith("image/"):
        shown = media_type or "text/plain"  # RFC 2397's default
        raise InvalidRequestError(
            f"{where!r} is a data: URI of type {shown!r}, not an image; {fix}", param=where
        )
    payload_len = len(url) - comma - 1
    estimate = payload_len * 3 // 4  # at most 2 bytes of padding off
    if estimate - 2 > limits.max_bytes:
        raise too_big(where, f"about {format_bytes(estimate)}", limits)
    payload = url[comma + 1 :]
    payload += "=" * (-len(payload) % 4)  # clients that drop the padding
    try:
        data = base64.b64decode(payload, validate=True)
    except ValueError as e:  # binascii.Error, or non-ASCII characters
        raise InvalidRequestError(
            f"{where!r} is a data: URI whose payload is not valid base64 ({e}); {fix}", param=where
        ) from None
    check_image_bytes(len(data), limits, where)
    return data


# Each accepted format's opener, by magic bytes. Calling the format's own ImageFile class (what Image.open calls)
# reads only the header, and skips Image.open's decompression-bomb check: that one uses Pillow's process-global
# MAX_IMAGE_PIXELS and warns or raises before we could name the numbers. Ours, on `max_pixels`, runs instead.
_OPENERS: dict[str, Callable[[io.BytesIO], PILImage.Image]] = {
    "PNG": PngImagePlugin.PngImageFile,
    "JPEG": JpegImagePlugin.jpeg_factory,  # a multi-picture JPEG (MPO) opens at its first picture
    "WebP": WebPImagePlugin.WebPImageFile,
    "GIF": GifImagePlugin.GifImageFile,  # opens at the first frame
}


def sniff_format(data: bytes) -> str | None:
    """'PNG', 'JPEG', 'WebP', 'GIF' from the magic bytes, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None


def to_rgb(im: PILImage.Image) -> np.ndarray:
    """RGB uint8 [H, W, 3], as transformers' `convert_to_rgb` makes it.

    Transparency (an alpha band, or a palette/greyscale `transparency` entry) is composited onto white; every
    other mode goes through PIL's convert("RGB"). Same steps as transformers.image_transforms.convert_to_rgb, which
    LlavaImageProcessor and CLIPImageProcessor apply to PIL images (do_convert_rgb=True).
    """
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = PILImage.alpha_composite(white, rgba).convert("RGB")
    else:
        rgb = im.convert("RGB")
    return np.asarray(rgb)


def decode_image(data: bytes, limits: ImageLimits, where: str) -> Image:
    """Decode a PNG, JPEG, WebP or GIF (first frame) into an Image with RGB pixels.

    Args:
        data: the encoded file.
        limits: max_bytes is checked first, max_pixels from the header before any pixel is decoded.
        where: the request field, e.g. "messages[0].content[1]"; it becomes the error's `param`.

    Raises:
        InvalidRequestError: too many bytes or pixels, not one of the four formats, or truncated/corrupt.
    """
    check_image_bytes(len(data), limits, where)
    fmt = sniff_format(data)
    if fmt is None:
        raise InvalidRequestError(
            f"{where!r} is not an image ({ACCEPTED}); convert it to one of those formats", param=where
        )
    corrupt = InvalidRequestError(
        f"{where!r} is a truncated or corrupt {fmt}; send the whole file", param=where
    )
    try:
        im = _OPENERS[fmt](io.BytesIO(data))  # header only
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
        # A GIF whose first frame outgrows its screen is checked inside Pillow, with Pillow's own limit.
        raise InvalidRequestError(
            f"{where!r} is a GIF with a first frame over {_mp(PILImage.MAX_IMAGE_PIXELS)} MP; "
            f"the limit is {_mp(limits.max_pixels)} MP (--max-image-pixels)",
            param=where,
        ) from None
    except Exception:  # Pillow raises SyntaxError, OSError, struct.error, IndexError, … on malformed headers
        raise corrupt from None
    with im:
        w, h = im.size
        if w * h > limits.max_pixels:
            raise InvalidRequestError(
                f"{where!r} is {w}x{h} pixels ({_mp(w * h)} MP); the limit is {_mp(limits.max_pixels)} MP "
                "(--max-image-pixels); send a smaller image",
                param=where,
            )
        if w == 0 or h == 0:
            raise corrupt
        try:
            rgb = to_rgb(im)
        except Exception:  # truncated data (OSError), bad chunks (SyntaxError), zlib/decoder errors, …
            raise corrupt from None
    rgb.setflags(write=False)  # shared by every prompt that holds this Image
    return Image(data=data, rgb=rgb)
