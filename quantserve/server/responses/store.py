"""The Responses API's store: the last N responses in memory, for `previous_response_id` and GET /v1/responses/{id}.

Bounded by count and by size (an agent's conversations grow with every tool result), least recently used out
first. An evicted id is remembered (ids only, a bounded list of them) so that a client can be told its response was
dropped rather than that it never existed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from quantserve.core.multimodal import Image
from quantserve.errors import InvalidRequestError, QuantserveError


class ResponseNotFoundError(QuantserveError):
    http_status = 404
    error_type = "invalid_request_error"
    code = "not_found"


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    messages: tuple[dict[str, Any], ...]  # the whole conversation, its own output included (chat messages)
    images: tuple[Image, ...] = ()  # the conversation's images, in the order of its image parts

    @cached_property
    def size(self) -> int:
        """Roughly the bytes it holds."""
        pictures = sum(len(img.data) + img.rgb.nbytes for img in self.images)
        return len(json.dumps([self.body, self.messages], ensure_ascii=False)) + pictures


class ResponseStore:
    """Thread-safe; `capacity` 0 stores nothing. `max_bytes` bounds what the stored responses hold together."""

    def __init__(self, capacity: int, max_bytes: int = 256 * 2**20):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.capacity <= 0 or item.size > self.max_bytes:
            return
        with self._lock:
            self._items[response_id] = item
            self._bytes += item.size
            while len(self._items) > self.capacity or self._bytes > self.max_bytes:
                old, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.size
                self._evicted[old] = None
                while len(self._evicted) > 16 * self.capacity:
                    self._evicted.popitem(last=False)

    def get(self, response_id: str, *, param: str | None = None) -> StoredResponse:
        """The stored response. Raises InvalidRequestError (a request field names it: 400) or
        ResponseNotFoundError (a URL names it: 404), saying whether it was evicted or never stored."""
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
                return item
            evicted = response_id in self._evicted
        if evicted:
            message = (
                f"response {response_id!r} is no longer stored: this server keeps the last {self.capacity} "
                f"responses, {self.max_bytes >> 20} MiB at most, in memory (--responses-store-size); send the whole "
                "conversation as input instead"
            )
        else:
            message = (
                f"no stored response has the id {response_id!r} (responses made with store=false, or before the "
                "server restarted, are not kept)"
            )
        if param is not None:
            raise InvalidRequestError(message, param=param, code="previous_response_not_found")
        raise ResponseNotFoundError(message)

    def delete(self, response_id: str) -> None:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is None:
                raise ResponseNotFoundError(f"no stored response has the id {response_id!r}")
            self._bytes -= item.size
