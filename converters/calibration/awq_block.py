"""AWQ's per-layer step for the calibration driver: search each input group's scale against the block's own
output, fold the scales into the block (its function unchanged until the weights are rounded), then clip and
round. The token mixer's scales come from `mixer_scales` (attention, or Qwen3.5's Gated DeltaNet); a mixture of
experts' from awq_moe.py, a fused Phi-3 block's from awq_fused.py. layers.py holds what AWQ shares with RTN and
GPTQ (which linears a block has, capturing their inputs)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from quantserve.backends.torch.model import TransformerBlock
from quantserve.converters.calibration.awq import (
    apply_clip,
    apply_scale,
    quantize_awq,
    search_clip,
    search_scale,
)
from quantserve.converters.calibration.layers import (
    LINEARS,
    LayerResult,
    QuantizeOptions,
    block_linears,
    capture,
    deltanet,
    fused,
    mixer_linears,
    n_experts,
    quantize_block_gptq,
    set_dequantized,
)


def fold_awq_scales(
    block: TransformerBlock,
    s_qkv: torch.Tensor,
    s_o: torch.Tensor | None,
    s_mlp: torch.Tensor,
    s_down: torch.Tensor,
) -> None:
    """Fold AWQ's input scales into the block in place; its function is unchanged (up to rounding).

    input_layernorm / s_qkv with q/k/v · s_qkv; v_proj rows (and bias) / s_o with o_proj · s_o (only when v's
    outputs are o's inputs one to one, i.e. no GQA, as AutoAWQ); post_attention_layernorm / s_mlp with
    gate/up · s_mlp (Gemma: pre_feedforward_layernorm, whose weight is held as 1 + w); up_proj rows / s_down with
    down_proj · s_down.
    """
    fold_scales([*attention_folds(block, s_qkv, s_o), *mlp_folds(block, s_mlp, s_down)])


def mlp_folds(block: TransformerBlock, s_mlp: torch.Tensor, s_down: torch.Tensor) -> list[Fold]:
    mlp = block.mlp
    # Gemma's MLP reads its own norm; its post-attention one normalises attention's output instead
    mlp_norm = block.pre_feedforward_layernorm if block.sandwich else block.post_attention_layernorm
    return [
        (mlp_norm, None, [mlp.gate_proj, mlp.up_proj], s_mlp),
        (mlp.up_proj, None, [mlp.down_proj], s_down),
    ]


# AutoAWQ does not clip q/k: small errors there are amplified by the attention softmax. Phi-3's fused q|k|v is
# left unclipped for the same reason (AutoAWQ's name filter misses `qkv_proj` and clips it).
AWQ_NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.qkv_proj")
Fold = tuple[nn.Module, torch.Tensor | None, list[nn.Module], torch.Tensor]  # (prev op, its bias, linears, s)


def attention_folds(block: TransformerBlock, s_qkv: torch.Tensor, s_o: torch.Tensor | None) -> list[Fold]:
    attn = block.self_attn
    folds: list[Fold] = [(block.input_layernorm, None, [attn.q_proj, attn.k_proj, attn.v_proj], s_qkv)]
    if s_o is not None:
        folds.append((attn.v_proj, attn.v_proj.bias, [attn.o_proj], s_o))
    return folds


def fold_scales(folds: list[Fold]) -> None:
    """Divide each prev op (and bias) by its s and multiply its linears' input columns by it, in place."""
    for prev, bias, linears, s in folds:
        new_prev, new_ws, new_bias = apply_scale(prev.weight, [m.weight for m in linears], s, bias)
        prev.weight.copy_(new_prev)
        if bias is not None:
            bias.copy_(new_bias)
        for m, w in zip(linears, new_ws, strict=True):
            m.weight.copy_(w)


def linear_fn(x: torch.Tensor, ws) -> torch.Tensor:
    return F.linear(x, ws[0])


def scale_searcher(opt: QuantizeOptions) -> Callable[..., torch.Tensor]:
    return partial(
        search_scale, bits=opt.bits, group_size=opt.group_size, sym=opt.sym, duo_scaling=opt.duo_scaling,
        scale_dtype=opt.scale_dtype,
    )  # fmt: skip


def attention_scales(
    block: TransformerBlock, x_qkv, x_o, rope, search
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AWQ's scales for q|k|v (against the attention's output) and for o (against its own; only when v's outputs
    are o's inputs one to one, i.e. no GQA, as AutoAWQ)."""
    attn = block.self_attn

    def attn_fn(x: torch.Tensor, ws) -> torch.Tensor:
        names = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
        return functional_call(attn, dict(zip(names, ws, strict=True)), (x, rope))

    s_qkv = search(x_qkv, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], attn_fn)
    if attn.v_proj.out_features != attn.o_proj.in_features:
        return s_qkv, None
    return s_qkv, search(x_o, [attn.o_proj.weight], linear_fn)


def mixer_hooks(block: TransformerBlock) -> tuple[str, ...]:
    """The linears whose inputs the token mixer's AWQ scales are searched on: the first (the normed hidden state)
    and the last (o_proj, out_proj); none for a DeltaNet left dense."""
    names = mixer_linears(block)
    return (names[0], names[-1]) if names else ()


def mixer_scales(block: TransformerBlock, feats: dict, rope, search) -> tuple[list[Fold], dict]:
    """AWQ's scales for the token mixer, from the inputs captured at mixer_hooks (taken out of `feats`): the folds
    to apply, and each quantized linear's (input, scale or None).

    A DeltaNet's in_proj_qkv and in_proj_z share one scale, searched against the layer's output; in_proj_a and
    in_proj_b read the same normed input, so their columns take it too (they stay dense: exact). out_proj is not
    scaled: it reads the gated norm, whose weight is one per head dimension, shared by every head, with no
    per-channel place to fold a scale into."""
    names = mixer_linears(block)
    if not names:
        return [], {}
    x_in, x_out = (torch.cat(feats.pop(n)) for n in mixer_hooks(block))
    if not deltanet(block):
        s_qkv, s_o = attention_scales(block, x_in, x_out, rope, search)
        inputs = {n: (x_in, s_qkv) for n in LINEARS[:3]} | {"self_attn.o_proj": (x_out, s_o)}
        return attention_folds(block, s_qkv, s_o), inputs
    dn = block.linear_attn

    def deltanet_fn(x: torch.Tensor, ws) -> torch.Tensor:
        return functional_call(dn, {"in_proj_qkv.weight": ws[0], "in_proj_z.weight": ws[1]}, (x,))

    s_in = search(x_in, [dn.in_proj_qkv.weight, dn.in_proj_z.weight], deltanet_fn)
    folds: list[Fold] = [
        (block.input_layernorm, None, [dn.in_proj_qkv, dn.in_proj_z, dn.in_proj_a, dn.in_proj_b], s_in)
    ]
    return folds, {names[0]: (x_in, s_in), names[1]: (x_in, s_in), names[2]: (x_out, None)}


def awq_scale_block(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> dict:
    """AWQ's scale search for the block's four input groups, folded into the block in place (its function is
    unchanged until the weights are rounded). Returns, per linear, (its captured input, the scale that
    input is now divided by, or None), which the clipping search needs."""
    if n_experts(block):
        from quantserve.converters.calibration.awq_moe import (
            awq_scale_moe_block,  # (it builds on this module)
        )

        return awq_scale_moe_block(block, hidden, rope, opt)
    if fused(block):
        from quantserve.converters.calibration.awq_fused import awq_scale_fused_block

        return awq_scale_fused_block(block, hidden, rope, opt)
    mlp = block.mlp
    feats: dict[str, list[torch.Tensor]] = {}
    hooked = (*mixer_hooks(block), "mlp.gate_proj", "mlp.down_proj")
    capture(block, hidden, rope, hooked, lambda n, x: feats.setdefault(n, []).append(x), opt.batch_size)
    x_mlp, x_down = (torch.cat(feats.pop(n)) for n in hooked[-2:])

    def mlp_fn(x: torch.Tensor, ws) -> torch.Tensor:
        return functional_call(mlp, {"gate_proj.weight": ws[0], "up_proj.weight": ws[1]}, (x,))

    search = scale_searcher(opt)
    folds, inputs = mixer_scales(block, feats, rope, search)
    s_mlp = search(x_mlp, [mlp.gate_proj.weight, mlp.up_proj.weight], mlp_fn)
    s_down = search(x_down, [mlp.down_proj.weight], linear_fn)
    fold_scales([*folds, *mlp_folds(block, s_mlp, s_down)])
    return inputs | {
        "mlp.gate_proj": (x_mlp, s_mlp),
        "mlp.up_proj": (x_mlp, s_mlp),
        "mlp.down_proj": (x_down, s_down),
    }


def quantize_block_awq(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> LayerResult:
    inputs = awq_scale_block(block, hidden, rope, opt)
    # Clipping is searched on the scaled weights against the scaled inputs x / s (AutoAWQ's order).
    out: LayerResult = {}
    for name in block_linears(block):
        w = block.get_submodule(name).weight
        bits, group = opt.bits_for(name)
        if (
            name not in AWQ_NO_CLIP and inputs[name][0].numel()
        ):  # (an expert no token reached: nothing to fit)
            x, s = inputs[name]
            x = x.reshape(-1, x.shape[-1])
            x = x[:: max(1, x.shape[0] // 512)]  # search_clip's token subsample, taken before dividing
            x = x if s is None else x / s
            w = apply_clip(w, search_clip(w, x, bits, group, sym=opt.sym, scale_dtype=opt.scale_dtype))
        out[name] = quantize_awq(w, bits, group, not opt.sym, opt.scale_dtype, name), None
        set_dequantized(block, name, out[name][0])
    return out


def quantize_block_awq_gptq(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> LayerResult:
    """AWQ's scales, then GPTQ's rounding of the scaled weights against the scaled inputs' Hessians (the two
    stack: AWQ protects salient input channels, GPTQ compensates each rounding error in the columns after it).
    AWQ's clipping is left out: GPTQ's error feedback would undo most of it."""
    awq_scale_block(block, hidden, rope, opt)  # its captured inputs are the unscaled ones: GPTQ recaptures
    return quantize_block_gptq(block, hidden, rope, opt)
