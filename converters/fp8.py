"""`quantserve convert --quant fp8`: a dense HF checkpoint to FP8 weights, written as llm-compressor writes its
FP8_DYNAMIC preset (compressed-tensors `float-quantized`, docs/quantized-checkpoints.md, "FP8 in compressed-tensors").

Each linear of the decoder layers gets one scale per output channel, amax / 448 (its largest weight maps to e4m3's
largest value), stored in the weight's own dtype, and its weights are that scale's e4m3 values: the recipe of
llm-compressor's MinMax observer, and no calibration. The config declares dynamic per-token FP8 activations, which
engines with FP8 GEMMs (vLLM) apply and quantserve, decoding the weights in each matmul, does not. Everything else
(embeddings, norms, lm_head, MoE routers, Qwen3.5's DeltaNets, as the published recipes keep them) is copied as it is.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from quantserve.errors import ConfigError
from quantserve.formats import detect
from quantserve.formats.hf_config import TOKENIZER_FILES, is_llava
from quantserve.formats.safetensors_out import PlannedTensor, SafetensorsWriter
from quantserve.formats.staging import staged_output

log = logging.getLogger("quantserve.convert")

FP8_E4M3_MAX = 448.0
# compressed-tensors' own config for FP8_DYNAMIC (quant_scheme.py), as version 0.20 writes it
_CHANNEL_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "dynamic": False}
_TOKEN_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "dynamic": True}


# the routers of the mixtures of experts, by their checkpoints' names (Mixtral's is block_sparse_moe.gate)
_ROUTERS = (
    ".mlp.gate.weight",
    ".mlp.router.weight",
    ".mlp.shared_expert_gate.weight",
    ".block_sparse_moe.gate.weight",
)


def _quantized(name: str, shape: list[int]) -> bool:
    """A linear of a decoder layer that FP8 rounds (backends/torch/weights.py's decoder_linears, by name)."""
    return (
        len(shape) == 2
        and name.startswith("model.layers.")
        and name.endswith(".weight")
        and not name.endswith(_ROUTERS)
        and ".linear_attn." not in name
    )


def channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] as (float8_e4m3fn [N, K], scales [N, 1] in w's dtype). The scale is rounded to its dtype first,
    so that weight × scale is exactly what a reader computes."""
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax)).to(w.dtype)
    # a row so small that its scale underflows the dtype (fp16 below about 1.3e-5) keeps the smallest normal one
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(w.dtype).tiny))
    q = (w.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_checkpoint(src: Path, dst: Path, *, force: bool = False) -> Path:
    """Write the FP8 form of the dense checkpoint `src` into the directory `dst`.

    Raises:
        ConfigError: `src` is not a dense language-model checkpoint; dst exists without force.
    """
    from quantserve.backends.torch.weights import SafetensorsFiles

    t0 = time.perf_counter()
    spec = detect(src)
    if spec.format != "safetensors" or spec.scheme is not None:
        raise ConfigError(f"{src} is {spec.format}; --quant fp8 rounds a dense fp16/bf16/fp32 HF checkpoint")
    if is_llava(spec.config) or (spec.config or {}).get("vision_config"):
        raise ConfigError(f"{src} has a vision tower; --quant fp8 takes a language model checkpoint")
    files = SafetensorsFiles(spec.files)
    names = sorted(files.names())
    if files.stacked():
        raise ConfigError(f"{src} stacks its experts in one tensor; --quant fp8 takes one linear per tensor")
    shapes = {n: list(files.lazy(n).get_shape()) for n in names}
    dtypes = {n: files.lazy(n).get_dtype() for n in names}  # safetensors' spelling: "BF16"
    rounded = {n for n in names if _quantized(n, shapes[n])}
    if not rounded:
        raise ConfigError(f"{src}: no linear of a decoder layer (model.layers.N.*.weight) to round to FP8")
    plan: list[PlannedTensor] = []
    for n in names:
        if dtypes[n] not in ("F32", "F16", "BF16"):
            raise ConfigError(
                f"{src}: tensor '{n}' is {dtypes[n]}; --quant fp8 reads fp16/bf16/fp32 checkpoints"
            )
        if n in rounded:  # the scale in the weight's dtype, as compressed-tensors stores it
            plan += [PlannedTensor(n, "F8_E4M3", tuple(shapes[n])), PlannedTensor(n + "_scale", dtypes[n],
                                                                                   (shapes[n][0], 1))]  # fmt: skip
        else:
            plan.append(PlannedTensor(n, dtypes[n], tuple(shapes[n])))
    with staged_output(Path(dst), directory=True, force=force) as out:
        with SafetensorsWriter(out, plan) as writer:
            for n in tqdm(names, desc="quantize fp8", unit="tensor", leave=False):
                t = files.read(n)
                if n in rounded:
                    q, scale = channel_fp8(t)
                    writer.write(n, [_bytes(q)])
                    writer.write(n + "_scale", [_bytes(scale)])
                else:
                    writer.write(n, [_bytes(t)])
        config = dict(spec.config or {})
        # lm_head (a module even where it is tied to the embeddings) and every other linear left dense, so that
        # readers matching "Linear" skip them, as llm-compressor's recipes name them
        kept = {n.removesuffix(".weight") for n in names if n not in rounded and len(shapes[n]) == 2}
        ignore = ["lm_head", *sorted(kept - {"lm_head"} - {n for n in kept if "embed" in n})]
        config["quantization_config"] = {
            "config_groups": {
                "group_0": {
                    "format": "float-quantized",
                    "input_activations": {**_TOKEN_FP8, "strategy": "token"},
                    "output_activations": None,
                    "targets": ["Linear"],
                    "weights": {**_CHANNEL_FP8, "strategy": "channel"},
                }
            },
            "format": "float-quantized",
            "global_compression_ratio": None,
            "ignore": ignore,
            "kv_cache_scheme": None,
            "moe_sparsity_config": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": "0.20.1",
        }
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (spec.directory / name).is_file():
                shutil.copy2(spec.directory / name, out / name)
    log.info("rounded %d linears of %s to FP8 in %.1fs", len(rounded), src, time.perf_counter() - t0)
    return Path(dst)


def _bytes(t: torch.Tensor):
    """The tensor's bytes as they lie in memory (numpy has no bf16 or float8)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()
