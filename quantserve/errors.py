"""Typed errors a user can cause; the server maps these types (never messages) to OpenAI error objects."""

from __future__ import annotations


class QuantserveError(Exception):
    """Base class. `message` says what was wrong and how to fix it."""

    http_status = 500
    error_type = "server_error"
    code: str | None = None
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


# ---- model files (CLI exit code 2) -------------------------------------------------------------


class ModelFileError(QuantserveError):
    """A model file or directory is malformed, truncated, unsafe or of an unknown format."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_model_file"


class UnsupportedFormatError(ModelFileError):
    """The format was recognised but quantserve cannot load it (pickles, exotic quant methods, …)."""

    code = "unsupported_model_format"


class ModelNotFoundError(QuantserveError):
    """A model name or path that does not exist (unknown models.toml entry, missing file, not in the hub cache)."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class ConfigError(QuantserveError):
    """A bad models.toml, settings value or command-line option."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_config"


class BackendUnavailableError(QuantserveError):
    """The chosen backend cannot serve this model here (missing build feature, no GPU, …)."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "backend_unavailable"


def require_torch(what: str) -> None:
    """PyTorch is an extra (`quantserve[torch]`): what needs it says so, before anything imports it.

    Raises:
        BackendUnavailableError: torch is not installed, naming the extra.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise BackendUnavailableError(
            f"{what} needs PyTorch, which is not installed here: pip install 'quantserve[torch]' (GGUF models on "
            "the llama.cpp backend need none)"
        )


# ---- requests ----------------------------------------------------------------------------------


class InvalidRequestError(QuantserveError):
    """A request field has a bad value."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ChatTemplateError(InvalidRequestError):
    """The model has no chat template, or the template failed to render these messages."""

    code = "chat_template_error"


class EmbeddingsUnsupportedError(InvalidRequestError):
    code = "embeddings_unsupported"


class ServerOverloadedError(QuantserveError):
    """The request queue is full; the client should retry later."""

    http_status = 503
    error_type = "server_error"
    code = "server_overloaded"


class ModelUnavailableError(QuantserveError):
    """The loaded model cannot run any more: a part of it on another process or machine is gone."""

    http_status = 503


class ModelLoadingError(QuantserveError):
    http_status = 503
    error_type = "server_error"
    code = "model_loading"
