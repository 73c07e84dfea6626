"""Chat templates: a model's Jinja template rendered in jinja2's ImmutableSandboxedEnvironment."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from quantserve.errors import ChatTemplateError, ConfigError


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template rejected these messages: {message}", param="messages")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    # Same defaults as transformers' apply_chat_template (non-ASCII kept as is).
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    """Renders OpenAI-style messages into a prompt string, exactly as transformers would (trim_blocks,
    lstrip_blocks, loopcontrols, raise_exception, strftime_now), but sandboxed: templates come from model files."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "the model"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ConfigError(f"the chat template from {origin} does not parse: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> ChatTemplate:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read --chat-template file {p}: {exc.strerror}") from exc
        return cls(text, origin=str(p), **kw)

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template failed to render these messages: {exc}", param="messages"
            ) from exc
