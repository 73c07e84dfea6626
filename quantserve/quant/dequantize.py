"""GPTQ / AWQ / compressed-tensors / Marlin → a dense HF checkpoint holding exactly the dequantized weights.

What llama.cpp and other dense-only tools need to run or score a 4-bit checkpoint: `quantserve eval` scores these
outputs this way, so their perplexity is computed by the same code as every GGUF's. fp32 keeps `scale · (q − z)`
exact; fp16/bf16 round it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from quantserve.errors import ConfigError
from quantserve.formats import detect
from quantserve.formats.hf_config import TOKENIZER_FILES
from quantserve.formats.quant_read import open_quantized
from quantserve.formats.safetensors_out import PlannedTensor, SafetensorsWriter
from quantserve.formats.staging import staged_output

log = logging.getLogger("quantserve.convert")

_DTYPES = {"float32": ("F32", torch.float32), "float16": ("F16", torch.float16)}


def dequantize_checkpoint(src: Path, dst: Path, *, dtype: str = "float32", force: bool = False) -> Path:
    """Write the dense equivalent of the quantized checkpoint `src` into the directory `dst`.

    Raises:
        ConfigError: `src` is not a quantized HF checkpoint, or dst exists without force.
    """
    spec = detect(src)
    if spec.scheme is None:
        raise ConfigError(f"{src} is {spec.format}, not a quantized HF checkpoint (GPTQ, AWQ, Marlin, ...)")
    st_dtype, torch_dtype = _DTYPES[dtype]
    with open_quantized(spec) as ckpt, staged_output(Path(dst), directory=True, force=force) as out:
        linears = ckpt.linear_prefixes()
        shapes = {}
        for p in linears:  # a first pass for the shapes: the writer plans every tensor before the first byte
            w = ckpt.read_linear(p)
            shapes[p] = (w.N, w.K)
        plan: list[tuple[str, object]] = []
        for p in linears:
            plan.append((f"{p}.weight", p))
            bias = ckpt.read_bias(p, drop_zero=True)
            if bias is not None:
                plan.append((f"{p}.bias", bias))
        for name in ckpt.dense_names():
            plan.append((name, None))
        planned = []
        for name, what in plan:
            if isinstance(what, str):
                shape = shapes[what]
            elif isinstance(what, torch.Tensor):
                shape = tuple(what.shape)
            else:
                shape = tuple(ckpt.read_dense(name).shape)
            planned.append(PlannedTensor(name, st_dtype, shape))
        with SafetensorsWriter(out, planned) as writer:
            for name, what in tqdm(plan, desc="dequantize", unit="tensor", leave=False):
                if isinstance(what, str):
                    t = ckpt.read_linear(what).dequantize(torch.float32).t()  # [N, K] for nn.Linear
                elif isinstance(what, torch.Tensor):
                    t = what
                else:
                    t = ckpt.read_dense(name)
                writer.write(name, [t.to(torch_dtype).contiguous().numpy()])
        config = {
            k: v for k, v in ckpt.config.items() if k not in ("quantization_config", "compression_config")
        }
        config["torch_dtype"] = config["dtype"] = dtype
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (spec.directory / name).is_file():
                shutil.copy2(spec.directory / name, out / name)
    log.info("dequantized %s (%d linears) to %s", src, len(linears), dst)
    return Path(dst)
