"""A LLaVA HF checkpoint -> the two GGUF files llama.cpp's libmtmd serves: the language model and its mmproj.

The language model goes through the ordinary HF -> GGUF writer (any --quant); the vision tower and projector
become the mmproj at f16 or f32, named as llama.cpp names them (quantserve.gguf.mmproj).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from quantserve.formats.staging import check_destination
from quantserve.gguf import hf_to_gguf
from quantserve.gguf.hf_to_gguf import default_gguf_name
from quantserve.gguf.mmproj import hf_to_mmproj, mmproj_file_name

log = logging.getLogger("quantserve.convert")


@dataclass(frozen=True)
class LlavaGGUF:
    text: Path  # the language model, as --quant asked
    mmproj: Path  # the vision projector


def llava_to_gguf(
    src: Path,
    dst: Path,
    quant: str,
    mmproj_type: str = "f16",
    imatrix: Path | None = None,
    force: bool = False,
    nthread: int | None = None,
    progress: bool = True,
) -> LlavaGGUF:
    """Convert a LLaVA checkpoint to its text GGUF and its mmproj GGUF.

    Args:
        dst: a directory (created if needed; both files get llama.cpp's default names there, e.g.
            `Llava-1.5-7B-Q4_K_M.gguf` and `mmproj-Llava-1.5-7B-F16.gguf`), or the text model's `.gguf` path
            (the mmproj is written beside it).
        quant, imatrix, nthread: for the language model, as hf_to_gguf takes them.
        mmproj_type: "f16" (what llama.cpp ships) or "f32".
    Raises:
        ConfigError: a destination exists without force, an unknown quant or mmproj type.
        UnsupportedFormatError, ModelFileError: as hf_to_gguf and hf_to_mmproj raise them.
    """
    src, dst = Path(src), Path(dst)
    if dst.suffix.lower() == ".gguf":
        text, directory = dst, dst.parent
    else:
        text, directory = dst / default_gguf_name(src, quant), dst
    mmproj = directory / mmproj_file_name(src, mmproj_type)
    for path in (text, mmproj):  # refuse before writing either, so that no half pair is left behind
        check_destination(path, force)
    hf_to_mmproj(src, mmproj, mmproj_type, force=force)  # seconds; the language model can take minutes
    log.info("wrote the vision projector (mmproj, %s): %s", mmproj_type.upper(), mmproj)
    try:
        hf_to_gguf(src, text, quant, imatrix=imatrix, progress=progress, force=force, nthread=nthread)
    except BaseException:
        mmproj.unlink(missing_ok=True)  # no projector without its language model
        raise
    log.info("wrote the language model (%s): %s", quant.upper(), text)
    return LlavaGGUF(text, mmproj)
