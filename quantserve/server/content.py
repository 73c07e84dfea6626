"""Message content of any of the three APIs read into what chat templates take: text, and images in their places.

Each API writes an image part its own way: OpenAI chat `{"type": "image_url", "image_url": {"url", "detail"}}`,
Responses `{"type": "input_image", "image_url", "detail"}`, Anthropic `{"type": "image", "source": {"type":
"base64", "media_type", "data"} | {"type": "url", "url"}}`. A ContentReader reads one request for one model: texts
as they are, and each image as `{"type": "image"}` in the message's content list (as transformers' processors hand
them to a template), its URL or data URI kept, in order, for fetching and decoding after parsing. A message with no
image keeps string content, which every template takes. `detail` is accepted and has no effect: LLaVA sees every
image at its one size.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from quantserve.core.multimodal import Image
from quantserve.errors import InvalidRequestError
from quantserve.vision.fetch import MediaPolicy, load_image

TEXT = frozenset({"text"})
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
IMAGE = {"type": "image"}  # an image's place in a message's content, for the chat template


@dataclass
class ContentReader:
    model: str
    takes_images: bool = False
    max_images: int = 8
    images: list[tuple[str, str]] = field(default_factory=list)  # (URL or data URI, where), in order

    def text(self, content: Any, where: str, text_types: frozenset[str] = TEXT) -> str:
        """Content where only text belongs (system prompts, tool results): a string, or text parts joined.

        Raises:
            InvalidRequestError: naming the part: an image here, or a part of another kind.
        """
        read = self.content(content, where, text_types, images=False)
        assert isinstance(read, str)
        return read

    def content(
        self, content: Any, where: str, text_types: frozenset[str] = TEXT, *, images: bool = True
    ) -> str | list[dict[str, Any]]:
        """A message's content: a string; or, when it holds images, the list of its text and image parts.

        Raises:
            InvalidRequestError: naming the part: an image for a text-only model, too many images, a malformed
                image part, or a part of another kind.
        """
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise InvalidRequestError(f"'{where}' must be a string or a list of content parts", param=where)
        return join([self.part(p, f"{where}[{j}]", text_types, images=images) for j, p in enumerate(content)])

    def part(
        self, part: Any, at: str, text_types: frozenset[str] = TEXT, *, images: bool = True
    ) -> str | dict[str, Any]:
        """One content part: its text, or IMAGE for an image (whose source is kept)."""
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in text_types and isinstance(part.get("text"), str):
            return part["text"]
        if kind in IMAGE_PART_TYPES:
            self._image(part, at, allowed=images)
            return dict(IMAGE)
        raise InvalidRequestError(
            f"'{at}' has type {kind!r}; this route takes content parts of type "
            f"{' or '.join(sorted(text_types | ({'image'} if images and self.takes_images else set())))}",
            param=at,
        )

    def _image(self, part: dict[str, Any], at: str, *, allowed: bool) -> None:
        if not self.takes_images:
            raise InvalidRequestError(
                f"'{at}' is an image, but the model {self.model!r} takes text only (it has no vision encoder); "
                "send text, or serve a vision model (e.g. a LLaVA checkpoint)",
                param=at,
            )
        if not allowed:
            raise InvalidRequestError(f"'{at}' is an image; images are read in user messages only", param=at)
        url = image_source(part, at)
        if len(self.images) >= self.max_images:
            raise InvalidRequestError(
                f"'{at}' is image {len(self.images) + 1} of this request; the limit is {self.max_images} "
                "(--max-images)",
                param=at,
            )
        self.images.append((url, at))

    async def load(self, policy: MediaPolicy) -> list[Image]:
        """Fetch (URLs) and decode every image read so far, concurrently, in order.

        Raises:
            InvalidRequestError: the first image that cannot be had, naming where it is in the request.
        """
        if not self.images:
            return []
        return list(await asyncio.gather(*(load_image(url, policy, at) for url, at in self.images)))


def join(parts: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Parts read by ContentReader.part as a message's content: one string without images, else text and image
    parts in order (adjacent texts joined)."""
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)  # type: ignore[arg-type]
    out: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p, str):
            if out and out[-1]["type"] == "text":
                out[-1] = {"type": "text", "text": out[-1]["text"] + p}
            elif p:
                out.append({"type": "text", "text": p})
        else:
            out.append(p)
    return out


def image_source(part: dict[str, Any], at: str) -> str:
    """The URL or data URI of an image part in any of the three APIs' shapes."""
    kind = part["type"]
    if kind == "image":  # Anthropic
        source = part.get("source")
        stype = source.get("type") if isinstance(source, dict) else None
        if stype == "base64":
            media, data = source.get("media_type"), source.get("data")
            if not isinstance(media, str) or not isinstance(data, str):
                raise InvalidRequestError(
                    f"'{at}.source' needs media_type and data (base64)", param=f"{at}.source"
                )
            return f"data:{media};base64,{data}"
        if stype == "url" and isinstance(source.get("url"), str):
            return source["url"]
        raise InvalidRequestError(
            f'\'{at}.source\' must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}',
            param=f"{at}.source",
        )
    url = part.get("image_url")
    if kind == "image_url" and isinstance(url, dict):  # OpenAI chat; a bare string is accepted too
        url = url.get("url")
    if not isinstance(url, str) or not url:
        if kind == "input_image" and part.get("file_id"):
            raise InvalidRequestError(
                f"'{at}.file_id': this server keeps no files; send the image as image_url (a data: URI or an "
                "http(s) URL)",
                param=f"{at}.file_id",
            )
        raise InvalidRequestError(
            f"'{at}.image_url' must be a data: URI or an http(s) URL", param=f"{at}.image_url"
        )
    return url
