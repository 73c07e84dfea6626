"""gpt-oss: attention with biases and sinks, windowed and full layers alternating, and a biased MoE whose experts
the checkpoint stacks itself (backends/torch/gpt_oss.py). The torch backend runs it.

Writing it as GGUF is not done yet: llama.cpp's converter repacks the MXFP4 experts into its own MXFP4 blocks and
splits gate|up (conversion/gpt_oss.py), which quantserve's writer does not. `check` refuses it by name, so
`--backend auto` keeps gpt-oss on the torch backend and `quantserve convert` says what to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantserve.errors import UnsupportedFormatError
from quantserve.gguf.archs import ArchSpec


def _refuse(hp: Mapping[str, Any]) -> None:
    raise UnsupportedFormatError(
        "quantserve does not write gpt-oss as GGUF yet (its MXFP4 experts need llama.cpp's repacking); serve the "
        "checkpoint with --backend torch, or use a gpt-oss GGUF made by llama.cpp's convert_hf_to_gguf.py"
    )


GPT_OSS = ArchSpec(
    gguf_arch="gpt-oss",
    hf_model_types=("gpt_oss",),
    hf_architectures=("GptOssForCausalLM",),
    permute_qk=False,
    layer_tensors=(),
    check=_refuse,
    torch=True,
)
