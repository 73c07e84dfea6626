"""Start the llama.cpp backend for a detected model: a GGUF as is, a dense checkpoint after in-situ conversion."""

from __future__ import annotations

import logging
from pathlib import Path

from quantserve.core.runner import LoadedModel, ModelInfo
from quantserve.core.settings import EngineSettings
from quantserve.errors import BackendUnavailableError, ConfigError, ModelFileError
from quantserve.formats import ModelSpec, detect, find_mmproj, is_mmproj, read_gguf_info

log = logging.getLogger("quantserve")


def _dequantized(spec: ModelSpec) -> tuple[ModelSpec, object]:
    """A quantized HF checkpoint (GPTQ, AWQ, Marlin, compressed-tensors) as dense fp16 weights in a temporary
    directory (llama.cpp reads no such format); the handle keeps the directory alive while it is served."""
    import tempfile

    from quantserve.quant.dequantize import dequantize_checkpoint

    log.info("backend llamacpp: %s is %s; dequantizing it for conversion to GGUF", spec.path, spec.format)
    tmp = tempfile.TemporaryDirectory(prefix="quantserve-dequant-")
    dense = dequantize_checkpoint(spec.directory, Path(tmp.name) / "dense", dtype="float16")
    return detect(dense), tmp


def projector(gguf: Path, given: str | None) -> Path | None:
    """The vision projector to load with `gguf`: the one given (checked), else one found beside it, else None.

    Raises:
        ModelFileError: the given file is no valid mmproj GGUF (checked before libmtmd sees it).
    """
    if given is None:
        found = find_mmproj(gguf)
        if found is not None:
            log.info("vision projector %s found beside %s", found.name, gguf.name)
        return found
    path = Path(given).expanduser()
    if not path.is_file():
        raise ModelFileError(
            f"--mmproj {given}: no such file; give the mmproj GGUF `quantserve convert` wrote"
        )
    if not is_mmproj(read_gguf_info(path)):
        raise ModelFileError(
            f"--mmproj {given} is a GGUF but not a vision projector (no clip.has_vision_encoder); give the "
            "mmproj-*.gguf file"
        )
    return path


def load_llamacpp(spec: ModelSpec, settings: EngineSettings) -> LoadedModel:
    quant = settings.quant
    keep_alive = None
    if spec.scheme is not None:
        spec, keep_alive = _dequantized(spec)
        quant = quant or "q8_0"  # the 4-bit values need no more than 8 bits to stay (nearly) exact
    if spec.format == "safetensors":
        from quantserve.insitu import ensure_gguf

        log.info(
            "backend llamacpp: %s is a dense %s checkpoint; llama.cpp serves it after conversion to GGUF (%s)",
            spec.path,
            spec.quant.get("dtype", "?"),
            quant or "same precision",
        )
        gguf_file, handle = ensure_gguf(
            spec, quant, cache_dir=settings.cache_dir, use_cache=settings.use_cache
        )
        if keep_alive is not None and handle is None:
            keep_alive.cleanup()  # the GGUF is in the cache; the dequantized copy is no longer needed
        keep_alive = handle or keep_alive
        spec = detect(gguf_file)
    elif spec.format != "gguf":
        raise BackendUnavailableError(
            f"{spec.path} is a {spec.format} checkpoint, which llama.cpp cannot read; serve it with --backend torch"
        )
    elif quant and quant.lower() != str(spec.quant.get("file_type", "")).lower():
        raise ConfigError(
            f"{spec.path} is already a {spec.quant.get('file_type')} GGUF; --quant {quant} applies to dense "
            "checkpoints. Requantize offline with `quantserve convert`, or drop --quant",
            param="quant",
        )
    from quantserve.backends.llamacpp.model import LlamaCppRunner

    gguf_path = spec.files[0]
    info = read_gguf_info(gguf_path)
    for part in spec.files[1:]:
        read_gguf_info(part)
    log.info(
        "backend llamacpp: %s is GGUF (%s, %s); llama.cpp serves GGUF directly",
        gguf_path.name,
        info.architecture,
        spec.quant.get("file_type", "?"),
    )
    mmproj = projector(gguf_path, settings.llamacpp.mmproj)
    if settings.llamacpp.probe:
        from quantserve.backends.llamacpp.probe import PROBES

        PROBES.check(gguf_path, mmproj)
    if info.rank_outputs:
        log.info(
            "%s has a classification head (%d output(s)): served as a reranker on /v1/rerank, not for generation",
            gguf_path.name,
            info.rank_outputs,
        )
    runner = LlamaCppRunner(
        gguf_path, settings, n_ctx_train=info.context_length, mmproj=mmproj, rank_outputs=info.rank_outputs
    )
    return LoadedModel(
        runner=runner,
        info=ModelInfo(
            architecture=info.architecture, n_params=info.n_params, format="gguf", backend="llamacpp"
        ),
        chat_template=None if info.rank_outputs else info.chat_template,
        template_origin=str(gguf_path),
        bos_token=runner.special_text(runner.bos_token),
        eos_token=runner.special_text(runner.eos_token),
        keep_alive=keep_alive,
    )
