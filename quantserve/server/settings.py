"""ServerSettings: every `quantserve run` option; the field descriptions are the CLI's --help."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quantserve.core.rpc import parse_endpoints
from quantserve.core.settings import EngineSettings, parse_tensor_split
from quantserve.errors import ConfigError
from quantserve.registry import (
    ResolvedModel,
    find_models_toml,
    load_registry,
    parse_duration,
    parse_gpu_layers,
    resolve,
)
from quantserve.server.memory import parse_size
from quantserve.vision.fetch import MediaPolicy
from quantserve.vision.images import ImageLimits


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="models.toml name or alias, a path, or a hub id")
    models_file: str | None = Field(default=None, description="models.toml to use (default: ./models.toml)")
    models: str | None = Field(
        default=None,
        description="router mode: serve these models.toml entries ('all', or names separated by commas), each "
        "loaded on its first request. The default when no MODEL is given",
    )
    models_max: int = Field(
        default=0,
        ge=0,
        description="router mode: models loaded at once; the least recently used unloads (0: no cap)",
    )
    memory_budget: str | None = Field(
        default=None,
        description="router mode: memory the loaded models may take together, weights plus KV, e.g. 16G; the "
        "least recently used unload to stay under it (a model also unloads others when it would not fit in the "
        "memory free now)",
    )
    keep_alive: str | None = Field(
        default=None,
        description="router mode: unload a model idle this long (e.g. 300, 5m, 1h; models.toml's keep_alive "
        "wins; default: never)",
    )
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    api_key: str | None = Field(default=None, description="require 'Authorization: Bearer KEY' on /v1 routes")
    api_key_file: str | None = Field(
        default=None,
        description="read --api-key from this file (its first line), so that the key is in no command line",
    )
    allowed_origins: str | None = Field(
        default=None,
        description="web origins whose pages may call the API from a browser (CORS), comma-separated, e.g. "
        "http://localhost:3000, or *; off by default: browsers refuse cross-origin calls (the chat page at / is "
        "same-origin and needs none)",
    )
    backend: Literal["auto", "llamacpp", "torch"] = Field(default="auto", description="inference backend")
    quant: str | None = Field(
        default=None, description="quantize a dense fp16/bf16 checkpoint at load (q4_k_m, q8_0, …), cached"
    )
    no_cache: bool = Field(
        default=False, description="convert in-situ into a temporary directory, not the cache"
    )
    cache_dir: str | None = Field(default=None, description="in-situ cache (default: ~/.cache/quantserve)")
    ctx_size: int = Field(
        default=0, ge=0, description="longest sequence, prompt + output (0: the model's, ≤ 8192)"
    )
    kv_unified: bool = Field(
        default=False,
        description="share one KV pool of --kv-size cells among sequences (llama-server's layout): less memory and "
        "more throughput, but outputs then depend on what else runs (greedy and seeded results may differ between "
        "runs). Default: ctx-size cells per sequence, outputs independent of batching",
    )
    prefix_cache: bool = Field(
        default=True, description="reuse the KV of a shared prompt prefix (system prompts, chat history)"
    )
    swa_full: bool = Field(
        default=False,
        description="llama.cpp: keep every position in a sliding-window layer's KV (Gemma, gpt-oss), not only its "
        "window's. Default off, as llama-server: far less KV at long contexts, but a cached prefix is then reused "
        "only by a prompt that continues all of it (a chat's next turn), or that is shorter than the window",
    )
    kv_size: int = Field(default=0, ge=0, description="cells in the shared KV pool (0: 2 x ctx-size)")
    max_num_seqs: int = Field(default=4, ge=1, le=256, description="sequences generated together")
    max_queue_len: int = Field(
        default=64, ge=1, description="waiting requests beyond which the server answers 503"
    )
    n_batch: int = Field(default=512, ge=16, description="tokens per engine step (prefill chunk budget)")
    threads: int = Field(default=0, ge=0, description="CPU threads (0: all cores)")
    n_gpu_layers: str = Field(
        default="auto",
        description="layers llama.cpp puts on the GPU (Metal, CUDA): auto (every layer when the model and its KV "
        "fit the GPU's free memory with 1 GiB to spare, else as many as fit; 0 on a CPU-only build), all, or a "
        "number",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="torch backend: split the model over this many ranks (GPUs on CUDA, processes on the CPU), "
        "each with a slice of every layer and of the KV cache (vLLM's --tensor-parallel-size)",
    )
    rpc: str | None = Field(
        default=None,
        description="llama.cpp: RPC workers (`quantserve rpc-worker` on other machines), host:port[,host:port...]; "
        "their devices take the model's layers, as --tensor-split says. The model then runs in a child process, "
        "so a worker that dies fails requests (503) instead of the server",
    )
    rpc_timeout: float = Field(
        default=300.0,
        gt=0,
        description="with --rpc: seconds the model's engine may have work without finishing a step before its "
        "workers count as hung, and the model restarts",
    )
    tensor_split: str | None = Field(
        default=None,
        description="llama.cpp: share of the offloaded model per device, in llama.cpp's device order (RPC workers "
        "as listed, then this machine's GPUs), e.g. 3,1 (default: by free memory)",
    )
    split_mode: Literal["layer", "row", "none"] = Field(
        default="layer",
        description="llama.cpp with several devices: layer (whole layers per device), row (each matrix split "
        "across CUDA GPUs), none (everything on --main-gpu)",
    )
    main_gpu: int = Field(
        default=0,
        ge=0,
        description="llama.cpp: the device for --split-mode none, and row mode's small tensors",
    )
    cache_type_k: str = Field(default="f16", description="KV cache type for K (f16, q8_0, q4_0, …)")
    cache_type_v: str = Field(default="f16", description="KV cache type for V (f16, q8_0, q4_0, …)")
    flash_attn: Literal["auto", "on", "off"] = Field(
        default="auto", description="flash attention (auto: llama.cpp decides)"
    )
    cuda_graphs: bool = Field(
        default=True,
        description="torch backend on CUDA: replay decode steps as CUDA graphs, captured at start for batch sizes "
        "up to --max-num-seqs (--no-cuda-graphs: every step eager, like vLLM's --enforce-eager)",
    )
    seed: int | None = Field(default=None, description="default seed for requests that give none")
    mmproj: str | None = Field(
        default=None,
        description="vision projector GGUF for a LLaVA text GGUF (llama.cpp; default: an mmproj GGUF beside it)",
    )
    chat_template: str | None = Field(
        default=None, description="Jinja file overriding the model's chat template"
    )
    reasoning: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="thinking models: 'on' or 'off' switches thinking for every request that does not say "
        "(chat_template_kwargs.enable_thinking, Anthropic's thinking); 'auto' keeps the template's default",
    )
    reasoning_format: Literal["auto", "none"] = Field(
        default="auto",
        description="'auto': a thinking model's reasoning comes apart from its answer (reasoning_content, "
        "Anthropic thinking blocks, Responses reasoning items); 'none': left in the content as written",
    )
    reasoning_budget: int | None = Field(
        default=None,
        ge=0,
        description="most reasoning tokens per reply; then the end of the thinking block is written into the "
        "reply and the model answers (default: unbounded; 0: no thinking)",
    )
    responses_store_size: int = Field(
        default=1024, ge=0, description="responses kept for previous_response_id (/v1/responses; 0: none)"
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="largest request body (else 413)"
    )
    max_image_bytes: int = Field(
        default=20 * 1024 * 1024, ge=1, description="largest image, as a file (data: URI or fetched URL)"
    )
    max_images: int = Field(default=8, ge=0, description="images per request")
    max_image_pixels: int = Field(
        default=4096 * 4096,
        ge=1,
        description="pixels per image, width x height (a guard against decompression bombs; the decoded image "
        "takes 3 bytes a pixel, so a request may hold up to --max-images x this x 3 bytes)",
    )
    image_urls: bool = Field(
        default=True,
        description="fetch http(s) image URLs (never from loopback, private, link-local or metadata addresses); "
        "off: images only as data: URIs",
    )
    allowed_media_domains: str | None = Field(
        default=None,
        description="fetch image URLs only from these comma-separated hosts and their subdomains (an IP address "
        "listed here is allowed even if private)",
    )
    image_timeout: float = Field(
        default=10.0, gt=0, description="seconds to connect to and read an image URL"
    )
    graceful_timeout: float = Field(
        default=30.0, ge=0, description="seconds in-flight requests get on SIGTERM"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="log verbosity"
    )

    def media_policy(self) -> MediaPolicy:
        domains = tuple(d.strip().lower() for d in (self.allowed_media_domains or "").split(",") if d.strip())
        limits = ImageLimits(self.max_image_bytes, self.max_images, self.max_image_pixels)
        return MediaPolicy(
            allow_urls=self.image_urls, allowed_domains=domains, timeout=self.image_timeout, limits=limits
        )

    @field_validator("n_gpu_layers", mode="before")
    @classmethod
    def _gpu_layers(cls, v: int | str) -> str:
        parse_gpu_layers(v)  # raises with what is accepted
        return str(v).strip().lower()

    @field_validator("rpc")
    @classmethod
    def _rpc(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_endpoints(v)
            except ConfigError as exc:  # pydantic reports ValueErrors
                raise ValueError(exc.message.removeprefix("--rpc ")) from None
        return v

    @field_validator("tensor_split")
    @classmethod
    def _split(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_tensor_split(v)
            except ConfigError as exc:
                raise ValueError(exc.message.removeprefix("--tensor-split ")) from None
        return v

    @field_validator("memory_budget")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_size(v)
            except ValueError:
                raise ValueError(f"{v!r} is not a size; write e.g. 16G or 512M") from None
        return v

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: str | None) -> str | None:
        for origin in cors_origins(v):
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(
                    f"{origin!r} is not an origin; write scheme://host[:port], e.g. http://localhost:3000"
                )
        return v

    @model_validator(mode="before")
    @classmethod
    def _key_file(cls, data: dict) -> dict:
        """--api-key-file becomes --api-key, read once: a child process gets the key, not the file."""
        if not isinstance(data, dict) or data.get("api_key_file") is None:
            return data
        path = data["api_key_file"]
        if data.get("api_key") is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        try:
            key = Path(path).read_text().splitlines()[0].strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read a key from {path}: {exc}") from None
        except IndexError:
            key = ""
        if not key:
            raise ValueError(f"{path} holds no key on its first line")
        return {**data, "api_key": key, "api_key_file": None}

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is not None:
            parse_duration(v, "")
        return v

    @property
    def router_mode(self) -> bool:
        """Several models from models.toml, each loaded on demand: no MODEL given, or --models."""
        return self.model is None or self.models is not None

    def engine_settings(self) -> EngineSettings:
        options = self.model_dump(exclude=SERVER_ONLY)
        return EngineSettings.from_options(**options, use_cache=not self.no_cache)

    def resolve_model(self) -> tuple[ResolvedModel, EngineSettings]:
        resolved = resolve(self.model, load_registry(find_models_toml(self.models_file)))
        return resolved, self.engine_settings()


def cors_origins(value: str | None) -> list[str]:
    """--allowed-origins as a list (empty: CORS off)."""
    return [o.strip().rstrip("/") for o in (value or "").split(",") if o.strip()]


# Fields the HTTP server reads itself; every other field is an engine setting, passed on by name.
SERVER_ONLY = {
    "model", "models_file", "models", "models_max", "memory_budget", "keep_alive",
    "host", "port", "api_key", "api_key_file", "allowed_origins", "no_cache", "responses_store_size", "max_body_bytes",
    "graceful_timeout", "log_level", "max_image_bytes", "max_images", "max_image_pixels",
    "image_urls", "allowed_media_domains",
    "image_timeout", "rpc_timeout",
}  # fmt: skip
