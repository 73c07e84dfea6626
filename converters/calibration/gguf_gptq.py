"""Calibrated GGUF: llama.cpp's file type and block scales, with GPTQ choosing the codes inside the blocks.

`quantserve convert --src HF --dst out.gguf --quant q4_k_m --calib builtin` runs three steps:
1. An importance matrix from the calibration tokens (mean squared input of every linear, llama-imatrix's
   quantity, on the full-precision model), unless --imatrix names one.
2. llama.cpp's own quantizer with that matrix: the file type's tensor mix, block layout and per-block scales
   (and mins) are exactly what llama-quantize would write.
3. Layer by layer, as GPTQ's reference does, each linear's codes are re-chosen by GPTQ against its input
   Hessian, on the grid its blocks' scales fix (gguf/codes.py), and written over the old ones in place.
   Later layers are calibrated on the outputs of the already-rounded ones.

The tensors keep llama.cpp's types, layout and sizes to the byte; only the integer codes differ, so every GGUF
reader loads it. The header adds llama-quantize's quantize.imatrix.* keys (file "quantserve", its entry count,
the calibration described as its dataset and one chunk): some 200 bytes. Types GPTQ cannot round here (Q2_K,
Q3_K, IQ*) keep llama.cpp's codes, and the report names them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from tqdm import tqdm

from quantserve.backends.torch.model import ModelArgs, RotaryEmbedding
from quantserve.converters.calibration.driver import EMBED, SafetensorsReader, empty_block, load_layer
from quantserve.converters.calibration.gptq import GPTQ
from quantserve.converters.calibration.layers import LINEARS, SAME_INPUT, SEQUENTIAL, capture, run_block
from quantserve.errors import ConfigError
from quantserve.formats import detect, read_gguf_info
from quantserve.formats.staging import staged_output, temporary_sibling
from quantserve.gguf import codes
from quantserve.gguf.archs import arch_for_hf
from quantserve.gguf.hf_to_gguf import hf_to_gguf
from quantserve.gguf.quant_types import parse_quant
from quantserve.gguf.tensor_math import qk_gguf_rows_for_hf, qk_hf_rows_for_gguf
from quantserve.gguf.tensors import GGUFTensorReader

log = logging.getLogger("quantserve.convert")


@dataclass(frozen=True)
class CalibratedGGUF:
    path: Path
    seconds: float
    n_rounded: int  # linears whose codes GPTQ chose
    kept: list[str] = field(default_factory=list)  # linears of types GPTQ does not round (llama.cpp's codes)
    imatrix: str = "computed"  # "computed" from the calibration tokens, or the --imatrix file used


def write_imatrix(path: Path, sums: dict[str, np.ndarray], n_tokens: int, dataset: str) -> Path:
    """An importance matrix GGUF as llama-imatrix writes it: `<weight>.in_sum2` (Σ x² per input column) and
    `<weight>.counts` (tokens seen) per GGUF weight name, plus the imatrix.* keys (gguf/imatrix.py reads it)."""
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [dataset])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", n_tokens)
    for name, s in sums.items():
        w.add_tensor(f"{name}.in_sum2", s.astype(np.float32).reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.array([[n_tokens]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@torch.no_grad()
def calibrated_gguf(
    src: Path,
    dst: Path,
    quant: str,
    tokens: torch.Tensor,
    *,
    calibration: str = "given tokens",
    imatrix: Path | None = None,
    act_order: bool = True,
    damp_percent: float = 0.01,
    round_codes: bool = True,
    batch_size: int = 8,
    nthread: int | None = None,
    progress: bool = True,
    force: bool = False,
) -> CalibratedGGUF:
    """Write `src` (a dense HF llama/mistral/qwen2/qwen3 checkpoint) as a GGUF of file type `quant`, its linears'
    codes chosen by GPTQ on `tokens` (int64 [n, T]). round_codes=False stops after llama.cpp's quantizer with
    the computed importance matrix (what that matrix alone gives; benchmarks).

    Raises:
        ConfigError: a float `quant` (nothing to round), bad tokens, dst exists without force.
        And what hf_to_gguf raises for an unconvertible checkpoint.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    target = parse_quant(quant)
    if target.name in ("f32", "f16", "bf16"):
        raise ConfigError(
            f"--calib rounds quantized types; {target.name} has nothing to round (drop --calib)"
        )
    spec = detect(src)
    if spec.format != "safetensors" or not spec.config:
        raise ConfigError(
            f"{src} is a {spec.format} model; calibrated GGUF conversion reads dense HF checkpoints"
        )
    args = ModelArgs.from_hf_config(spec.config)
    if args.num_experts or args.fused or args.sandwich_norms or args.deltanet or args.attn_sinks:
        raise ConfigError(
            f"calibrated rounding to GGUF (--calib) does not handle {args.arch} yet (a mixture of experts, fused "
            "projections, Gemma, Qwen3.5's DeltaNets or gpt-oss); convert it without --calib, or with an --imatrix "
            "from llama-imatrix"
        )
    if tokens.dim() != 2 or int(tokens.min()) < 0 or int(tokens.max()) >= args.vocab_size:
        raise ConfigError(f"calibration tokens must be [n, T] ids below {args.vocab_size}")
    arch = arch_for_hf(spec.config)
    reader = SafetensorsReader(spec.files)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with staged_output(dst, directory=False, force=force) as tmp:
        if imatrix is None:
            with temporary_sibling(dst, "imatrix") as im:
                sums = _input_energy(reader, args, tokens, device, batch_size, progress)
                names = {arch.gguf_name(f"{p}.weight"): s for p, s in sums.items()}
                write_imatrix(im, names, tokens.numel(), calibration)
                hf_to_gguf(
                    src,
                    tmp,
                    quant,
                    imatrix=im,
                    progress=progress,
                    force=True,
                    nthread=nthread,
                    imatrix_label="quantserve",
                )
        else:
            hf_to_gguf(src, tmp, quant, imatrix=imatrix, progress=progress, force=True, nthread=nthread)
        n_rounded, kept = 0, []
        if round_codes:
            n_rounded, kept = _round_codes(tmp, reader, args, arch, tokens, device, act_order, damp_percent,
                                           batch_size, progress)  # fmt: skip
    seconds = time.perf_counter() - t0
    if kept:
        log.warning("kept llama.cpp's rounding for %d linears of types GPTQ does not round: %s", len(kept),
                    ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))  # fmt: skip
    return CalibratedGGUF(dst, seconds, n_rounded, kept, "computed" if imatrix is None else str(imatrix))


def _first_layer_inputs(
    reader: SafetensorsReader, args: ModelArgs, tokens: torch.Tensor, device: torch.device
):
    """(the embedded calibration tokens, the rope table, an empty float32 block and its state dict)."""
    hidden = torch.nn.functional.embedding(tokens.to(device), reader.get(EMBED).to(device, torch.float32))
    n = tokens.shape[1]
    rope = RotaryEmbedding(args).to(device)(torch.arange(n, device=device), n - 1)
    block = empty_block(args, device)
    return hidden, rope, block, block.state_dict()


def _input_energy(
    reader, args: ModelArgs, tokens, device, batch_size: int, progress: bool
) -> dict[str, np.ndarray]:
    """Σ x² over the calibration tokens of every linear's input column, on the full-precision model (one
    forward pass per layer: hooks sum the inputs while the block computes the next layer's)."""
    hidden, rope, block, state = _first_layer_inputs(reader, args, tokens, device)
    acc: dict[str, torch.Tensor] = {}

    def hook(name: str, module, inputs, output) -> None:
        s = inputs[0].float().pow(2).reshape(-1, inputs[0].shape[-1]).sum(0)
        acc[name] = acc[name] + s if name in acc else s

    for name in sorted({SAME_INPUT.get(m, m) for m in LINEARS}):
        block.get_submodule(name).register_forward_hook(partial(hook, name))
    sums: dict[str, np.ndarray] = {}
    for i in tqdm(
        range(args.num_hidden_layers), desc="importance matrix", unit="layer", disable=not progress
    ):
        load_layer(reader, state, i)
        acc.clear()
        run_block(block, hidden, rope, batch_size, out=hidden)
        for name in LINEARS:
            sums[f"model.layers.{i}.{name}"] = acc[SAME_INPUT.get(name, name)].cpu().numpy()
    return sums


def _round_codes(path: Path, reader: SafetensorsReader, args: ModelArgs, arch, tokens, device, act_order: bool,
                 damp_percent: float, batch_size: int, progress: bool) -> tuple[int, list[str]]:  # fmt: skip
    """GPTQ's codes for every linear of the GGUF at `path`, written over llama.cpp's in place."""
    info = read_gguf_info(path)
    tensors = {t.name: t for t in info.tensors}
    gguf_reader = GGUFTensorReader(info)
    hidden, rope, block, state = _first_layer_inputs(reader, args, tokens, device)
    heads = {"self_attn.q_proj": args.num_attention_heads, "self_attn.k_proj": args.num_key_value_heads}
    n_rounded, kept = 0, []
    bar = tqdm(range(args.num_hidden_layers), desc="GPTQ codes", unit="layer", disable=not progress)
    with path.open("r+b") as out:
        for i in bar:
            load_layer(reader, state, i)
            for group in SEQUENTIAL:
                hooked = sorted({SAME_INPUT.get(m, m) for m in group})
                gptq = {m: GPTQ(block.get_submodule(m).in_features) for m in hooked}
                capture(block, hidden, rope, hooked, lambda m, x, g=gptq: g[m].add_batch(x), batch_size)
                for name in group:
                    src = SAME_INPUT.get(name, name)
                    last = all(SAME_INPUT.get(m, m) != src for m in group[group.index(name) + 1 :])
                    t = tensors[arch.gguf_name(f"model.layers.{i}.{name}.weight")]
                    qtype = GGMLQuantizationType(t.ggml_type)
                    raw = np.array(gguf_reader.raw_rows(t))
                    to_hf = to_gguf = None
                    if arch.permute_qk and name in heads:  # whole rows move (tensor_math.py)
                        to_hf = qk_gguf_rows_for_hf(raw.shape[0], heads[name])
                        to_gguf = qk_hf_rows_for_gguf(raw.shape[0], heads[name])
                        raw = raw[to_hf]
                    weight = block.get_submodule(name).weight
                    if qtype not in codes.SUPPORTED:
                        kept.append(t.name)
                        wq = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(weight.shape))
                        if last:
                            gptq[src].H = None
                    else:
                        scale, offset = codes.grid(raw, qtype)
                        q, wq = gptq[src].round_to_grid(
                            weight, torch.from_numpy(scale), torch.from_numpy(offset), *codes.code_range(qtype),
                            act_order, damp_percent, name=t.name, keep_hessian=not last,
                        )  # fmt: skip
                        raw = codes.write_codes(raw, qtype, q.cpu().numpy())
                        out.seek(t.offset)
                        out.write((raw if to_gguf is None else raw[to_gguf]).tobytes())
                        n_rounded += 1
                    weight.copy_(wq)
            if i + 1 < args.num_hidden_layers:
                run_block(block, hidden, rope, batch_size, out=hidden)
    return n_rounded, kept
