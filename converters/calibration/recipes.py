"""Mixed precision under a size budget: which linears are worth more bits.

`sensitivity` measures, for every decoder linear, the KL divergence of the model's final next-token
distribution when that one linear alone is rounded to the base setting (RTN) and everything else stays at full
precision. `plan_budget` then moves the linears with the most KL per extra bit to 8 bits until the average bits
per weight of the quantized linears (scales, zero points and g_idx counted as the GPTQ format stores them)
would pass the budget. The plan is a set of per-module overrides, written as GPTQModel's `dynamic` rules.

Memory: the sensitivity pass holds the whole model in float32 (it reruns the tail of the model once per linear,
which costs about half a forward pass each); the quantizer itself still holds one layer at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from quantserve.backends.torch.model import ModelArgs, RMSNorm, TransformerBlock
from quantserve.converters.calibration.driver import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    SafetensorsReader,
    empty_block,
    load_layer,
    ropes,
)
from quantserve.converters.calibration.layers import block_linears
from quantserve.errors import ConfigError
from quantserve.formats import detect
from quantserve.quant.rtn import quantize_rtn

log = logging.getLogger(__name__)

HIGH_BITS = 8  # what a sensitive linear is raised to


def linear_bpw(n: int, k: int, bits: int, group_size: int) -> float:
    """Bits per weight of an N x K linear stored as GPTQ: packed weights, fp16 scales and packed zero points per
    group, and the int32 g_idx per input column."""
    groups = 1 if group_size == -1 else k // group_size
    return bits + groups * (16 + bits) / k + 32 / n


@dataclass(frozen=True)
class Sensitivity:
    kl: dict[str, float]  # prefix -> mean KL(full || one linear rounded) over the scored positions, nats
    shapes: dict[str, tuple[int, int]]  # prefix -> (N, K)
    n_positions: int
    seconds: float


def linear_shapes(args: ModelArgs, deltanet: bool = False) -> dict[str, tuple[int, int]]:
    """(N, K) of every linear the quantizer rounds, by prefix (block_linears' names in each layer), read off one
    meta-device block of each layer kind: attention's, the MLP's or every expert's and the shared expert's, and
    a Gated DeltaNet's projections with `deltanet` (empty_block's rule)."""
    kinds: dict[str, dict[str, tuple[int, int]]] = {}
    shapes = {}
    for i in range(args.num_hidden_layers):
        kind = args.layer_types[i] if args.layer_types else ""
        if kind not in kinds:
            with torch.device("meta"):
                block = TransformerBlock(args, i)
            block.quantize_deltanet = deltanet and block.linear
            kinds[kind] = {n: tuple(block.get_submodule(n).weight.shape) for n in block_linears(block)}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in kinds[kind].items()}
    return shapes


@torch.no_grad()
def sensitivity(
    src: str | Path,
    tokens: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool = True,
    *,
    deltanet: bool = False,
    max_tokens: int = 256,
    max_positions: int = 256,
    progress: bool = True,
) -> Sensitivity:
    """KL of the final logits when each decoder linear alone is rounded to `bits`/`group_size` (RTN).

    tokens: int64 [n, T] calibration samples, of which the first `max_tokens` are used (whole samples, or the
    start of the first one): the pass runs the model once per linear, from that linear's layer on, so it costs
    about a hundred forward passes over them. KL is averaged over up to `max_positions` positions among them.
    deltanet: a Gated DeltaNet's projections are scored too (they are quantized with `--quantize-deltanet`).
    """
    import time

    t0 = time.perf_counter()
    tokens = tokens[: max(1, max_tokens // tokens.shape[1]), :max_tokens]
    spec = detect(src)
    if spec.format != "safetensors" or not spec.config:
        raise ConfigError(f"{src} is not a dense safetensors checkpoint; the sensitivity pass reads those")
    args = ModelArgs.from_hf_config(spec.config)
    reader = SafetensorsReader(spec.files, args.our_name)
    n_layers = args.num_hidden_layers
    windows = args.layer_windows or (0,) * n_layers
    blocks = []
    for i in range(n_layers):
        block = empty_block(args, "cpu", i, deltanet=deltanet)  # each layer as the model runs it
        if not block.linear:
            block.self_attn.window = windows[i]  # (Gemma's windows, norms and ropes; Qwen3.5's DeltaNets)
        if args.num_experts:
            block.mlp.calibrate_all = (
                False  # only the routed experts: nothing here needs inputs of the others
            )
        load_layer(reader, block.state_dict(), i, args.norm_offset)
        blocks.append(block)
    embed = reader.get(EMBED).float()
    head = embed if args.tie_word_embeddings or LM_HEAD not in reader else reader.get(LM_HEAD).float()
    norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
    norm.weight.copy_(reader.get(FINAL_NORM).float() + args.norm_offset)
    n = tokens.shape[1]
    rope, local = ropes(args, n, "cpu")
    layer_ropes = [local if w else rope for w in windows]
    step = max(1, tokens.numel() // max_positions)
    picks = torch.arange(tokens.numel())[::step][:max_positions]  # flat positions scored

    def logp(h: torch.Tensor) -> torch.Tensor:
        logits = norm(h).reshape(-1, h.shape[-1])[picks] @ head.t()
        if args.final_softcap:  # Gemma 2's cap on the final logits
            logits = torch.tanh(logits / args.final_softcap) * args.final_softcap
        return F.log_softmax(logits, dim=-1)

    x = F.embedding(tokens, embed)
    inputs = [x * args.hidden_size**0.5 if args.embed_scale else x]  # the full-precision input of every layer
    for block, r in zip(blocks, layer_ropes, strict=True):
        inputs.append(block(inputs[-1], r))
    ref = logp(inputs[-1])
    kl: dict[str, float] = {}
    shapes = linear_shapes(args, deltanet)
    bar = tqdm(total=len(shapes), desc="sensitivity", unit="linear", disable=not progress)
    for i, block in enumerate(blocks):
        for name in block_linears(block):
            linear = block.get_submodule(name)
            w = linear.weight.detach().clone()
            linear.weight.copy_(quantize_rtn(w, bits, group_size, sym, torch.float16, name).dequantize().t())
            h = block(inputs[i], layer_ropes[i])
            for later, r in zip(blocks[i + 1 :], layer_ropes[i + 1 :], strict=True):
                h = later(h, r)
            linear.weight.copy_(w)
            lq = logp(h)
            kl[f"model.layers.{i}.{name}"] = float((ref.exp() * (ref - lq)).sum(-1).mean())
            bar.update(1)
    bar.close()
    return Sensitivity(kl, shapes, len(picks), time.perf_counter() - t0)


@dataclass(frozen=True)
class BudgetPlan:
    overrides: dict[str, tuple[int, int]]  # prefix -> (bits, group_size), the linears raised
    bpw: float  # average bits per weight of the quantized linears under this plan
    base_bpw: float  # ... with none raised


def plan_budget(
    sens: Sensitivity, bits: int, group_size: int, budget: float, high_group: int | None = None
) -> BudgetPlan:
    """Raise the linears with the most KL per extra bit to HIGH_BITS while the linears' average stays within
    `budget` bits per weight.

    Raises:
        ConfigError: the budget is below the base setting's own size.
    """
    high_group = high_group or group_size
    weights = {p: n * k for p, (n, k) in sens.shapes.items()}
    total = sum(weights.values())
    cost = {p: linear_bpw(n, k, bits, group_size) * n * k for p, (n, k) in sens.shapes.items()}
    base = sum(cost.values()) / total
    if budget < base:
        raise ConfigError(
            f"--bits-budget {budget} is below {base:.3f}, the size of {bits}-bit group {group_size} itself",
            param="bits_budget",
        )
    extra = {
        p: linear_bpw(n, k, HIGH_BITS, high_group) * n * k - cost[p] for p, (n, k) in sens.shapes.items()
    }
    order = sorted(sens.kl, key=lambda p: sens.kl[p] / extra[p], reverse=True)
    spent = sum(cost.values())
    overrides: dict[str, tuple[int, int]] = {}
    for p in order:
        if (spent + extra[p]) / total > budget:
            continue  # a smaller linear further down may still fit
        overrides[p] = (HIGH_BITS, high_group)
        spent += extra[p]
    log.info("bits budget %.3f: %d of %d linears at %d bits", budget, len(overrides), len(order), HIGH_BITS)
    return BudgetPlan(overrides, spent / total, base)
