"""HF safetensors checkpoint -> GGUF at any llama.cpp file type, written directly or via llama.cpp's quantizer."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from quantserve.errors import ConfigError, ModelFileError, UnsupportedFormatError
from quantserve.formats import detect
from quantserve.formats.staging import (
    check_destination,
    ensure_free_space,
    staged_output,
    temporary_sibling,
)
from quantserve.gguf.archs import arch_for_hf
from quantserve.gguf.native_quant import quantize_file
from quantserve.gguf.params import normalize_hparams
from quantserve.gguf.quant_types import QUANTS, parse_quant
from quantserve.gguf.safetensors_source import SafetensorsSource
from quantserve.gguf.tokenizer import vocab_from_hf
from quantserve.gguf.writer import default_file_name, plan_tensors, write_gguf

log = logging.getLogger(__name__)
# the lossless intermediate for llama.cpp's quantizer: the checkpoint's own float type
_INTERMEDIATE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def hf_to_gguf(
    src: Path,
    dst: Path,
    quant: str = "q8_0",
    imatrix: Path | None = None,
    progress: bool = True,
    force: bool = False,
    nthread: int | None = None,
    imatrix_label: str | None = None,
) -> Path:
    """Convert an HF checkpoint (llama, mistral, qwen2, qwen3, phi3, gemma2/3, and the MoE qwen3_moe, mixtral and
    gpt_oss, whose MXFP4 experts stay MXFP4) to one GGUF file.

    F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 are written directly with gguf-py (what convert_hf_to_gguf.py,
    then llama-quantize for the 4/5-bit types, would produce). K-quants, i-quants, and any type with an
    importance matrix, are written first as a lossless F16/BF16/F32 GGUF beside dst, then quantized by
    llama.cpp's `llama_model_quantize` in-process.

    Args:
        src: the checkpoint directory (config.json, tokenizer.json, *.safetensors).
        dst: the .gguf file to create.
        quant: a file type such as "q4_k_m" (case-insensitive; "q4k" means q4_k_m).
        imatrix: an importance matrix GGUF from llama-imatrix (quantized types only).
        progress: tqdm bars while writing.
        force: replace an existing dst.
        nthread: threads for llama.cpp's quantizer (default: all cores).
        imatrix_label: what the output's quantize.imatrix.file key says (default: the imatrix path).
    Returns:
        dst.
    Raises:
        ConfigError: unknown quant, a type that needs an imatrix without one, imatrix with a float type, dst
            exists without force.
        UnsupportedFormatError: not a dense safetensors checkpoint, or an unsupported architecture.
        ModelFileError: missing config.json/tokenizer.json or malformed files.
        ConversionError: the disk filled up or llama.cpp's quantizer failed (nothing is left behind).
    """
    src, dst = Path(src), Path(dst)
    target = parse_quant(quant)
    if target.needs_imatrix and imatrix is None:
        raise ConfigError(
            f"{target.name.upper()} needs an importance matrix: llama.cpp will not make it without one (its "
            "result would be garbage). Convert with --calib builtin (quantserve computes the matrix from "
            "calibration text) or --imatrix FILE (llama-imatrix's), or pick a type that needs none, e.g. iq4_xs",
            param="quant",
        )
    if imatrix is not None and target.name in ("f32", "f16", "bf16"):
        raise ConfigError(
            f"--imatrix only applies to quantized types, not {target.name}; drop it or pick e.g. q4_k_m"
        )
    spec_model = detect(src)
    if spec_model.format != "safetensors":
        raise UnsupportedFormatError(
            f"{src} is a {spec_model.format} model; HF→GGUF converts dense F32/F16/BF16 safetensors checkpoints "
            "(a GGUF converts the other way, to an HF directory)"
        )
    if not spec_model.config:
        raise ModelFileError(f"{spec_model.directory} has no config.json; it is needed to convert the model")
    check_destination(dst, force)
    arch = arch_for_hf(spec_model.config)
    hp = normalize_hparams(spec_model.config)
    if arch.check is not None:
        arch.check(hp)
    vocab = (arch.vocab(spec_model.directory, hp) if arch.vocab else None) or vocab_from_hf(
        spec_model.directory, hp
    )
    source = SafetensorsSource(spec_model)
    native = target.direct is None or imatrix is not None
    if native and spec_model.quant.get("experts") == "mxfp4":
        raise ConfigError(
            f"--quant {target.name}: {src.name}'s experts are MXFP4 already, which llama.cpp's quantizer will not "
            "requantize; use q8_0, bf16 or f16, which keep the experts MXFP4 and give the rest that type",
            param="quant",
        )
    first = QUANTS[_INTERMEDIATE[spec_model.quant["dtype"]]] if native else target
    tensors = plan_tensors(arch, source, hp, first)
    size = sum(t.n_bytes for t in tensors)
    # a quantized file takes at most ~8.5 bits (Q8_0) per weight
    final = sum(math.prod(t.ne) for t in tensors) * 17 // 16 if native else 0
    ensure_free_space(dst.parent, size + final, f"converting {src.name} to {target.name.upper()}")
    with staged_output(dst, directory=False, force=force) as tmp:
        if native:
            with temporary_sibling(dst, first.name) as intermediate:
                write_gguf(intermediate, arch, hp, tensors, vocab, first, spec_model.directory, progress)
                log.info("quantizing %s to %s with llama.cpp", intermediate.name, target.name.upper())
                quantize_file(intermediate, tmp, target, imatrix, nthread, progress, imatrix_label)
        else:
            write_gguf(tmp, arch, hp, tensors, vocab, target, spec_model.directory, progress)
    return dst


def default_gguf_name(src: Path, quant: str) -> str:
    """The file name convert_hf_to_gguf.py gives `src` converted to `quant` when its --outfile is a directory.

    Raises: what hf_to_gguf raises for an unconvertible checkpoint or an unknown quant.
    """
    target = parse_quant(quant)
    spec_model = detect(src)
    if spec_model.format != "safetensors" or not spec_model.config:
        raise UnsupportedFormatError(f"{src} is not a dense safetensors checkpoint with a config.json")
    arch, hp = arch_for_hf(spec_model.config), normalize_hparams(spec_model.config)
    tensors = plan_tensors(arch, SafetensorsSource(spec_model), hp, QUANTS["f32"])  # only the shapes count
    return default_file_name(tensors, spec_model.directory, target)
