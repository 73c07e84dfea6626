"""Fuse the linears that read the same input into one (q|k|v, gate|up), after loading, for the kernels' sake.

At decode every linear is a separate launch that streams its weight: three small ones (q, k, v) and two large
ones (gate, up) per layer become one each, which halves the launches of a layer and gives the GEMM wider tiles of
work. Dense weights are concatenated; Marlin weights are concatenated in their packed layout, which commutes with
the repack (kernels/marlin.py, concat_n). Linears that cannot be fused (a mix of dense and quantized, different
group sizes or act-order permutations) stay as they are. The checkpoint's names stay on the unfused modules until
this runs; nothing loads weights after it.

A mixture of experts' quantized experts are stacked for the grouped kernel here too (`group_experts`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from quantserve.backends.torch.model import MLP, Transformer
from quantserve.backends.torch.moe import SparseMoe
from quantserve.backends.torch.quant_linear import QuantLinear
from quantserve.kernels.marlin import concat_n
from quantserve.kernels.qweight import QuantLayoutError
from quantserve.kernels.w4a16_moe import stack_experts
from quantserve.kernels.w4a16_plain import PlainState

log = logging.getLogger("quantserve.torch")


def fuse_linears(parts: list[nn.Module], name: str) -> nn.Module | None:
    """One module computing the parts' outputs side by side, or None when they cannot be fused."""
    if all(type(p) is nn.Linear for p in parts):
        w = parts[0].weight
        fused = nn.Linear(
            w.shape[1], sum(p.out_features for p in parts), bias=False, device=w.device, dtype=w.dtype
        )
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if any(p.bias is not None for p in parts):
            fused.bias = nn.Parameter(
                torch.cat([p.bias if p.bias is not None else w.new_zeros(p.out_features) for p in parts]),
                requires_grad=False,
            )
        return fused
    if all(isinstance(p, QuantLinear) and p.marlin is not None for p in parts):
        try:
            marlin = concat_n([p.marlin for p in parts], name)
        except QuantLayoutError as exc:
            log.debug("not fused: %s", exc)
            return None
        biases = [p.bias for p in parts]
        bias = None
        if any(b is not None for b in biases):
            ref = next(b for b in biases if b is not None)
            bias = torch.cat(
                [
                    b if b is not None else ref.new_zeros(p.out_features)
                    for b, p in zip(biases, parts, strict=True)
                ]
            )
        first = parts[0]
        return QuantLinear.from_marlin(
            marlin, bias, dtype=first.activation_dtype, device=marlin.qweight.device, name=name,
            kernel=first.layer.kernel.name,
        )  # fmt: skip
    return None


def fuse_projections(model: Transformer) -> int:
    """Fuse q|k|v and gate|up in every layer where they can be, then drop each quantized linear's Marlin weight
    (its kernel prepared what it needs). Returns how many groups were fused."""
    count = 0
    for i, layer in enumerate(model.model.layers):
        attn, mlp = getattr(layer, "self_attn", None), layer.mlp  # (a DeltaNet layer has no self_attn)
        if attn is not None and attn.qkv_proj is not None:  # fused in the checkpoint (phi3): nothing to do
            continue
        qkv = None if attn is None else fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj],
                                                      f"model.layers.{i}.self_attn.qkv_proj")  # fmt: skip
        if qkv is not None:
            attn.qkv_proj = qkv
            del attn.q_proj, attn.k_proj, attn.v_proj
            count += 1
        if not isinstance(mlp, MLP):  # a mixture of experts
            continue
        gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj], f"model.layers.{i}.mlp.gate_up_proj")
        if gate_up is not None:
            mlp.gate_up_proj = gate_up
            del mlp.gate_proj, mlp.up_proj
            count += 1
    log.info("fused %d of %d linear groups (q|k|v, gate|up)", count, 2 * len(model.model.layers))
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)]
    if moe:
        grouped = sum(group_experts(m) for m in moe)
        log.info("%d of %d expert layers run on the grouped W4A16 kernel", grouped, len(moe))
    for m in model.modules():  # the kernels hold their own copies (or the same tensors): no second one stays
        if isinstance(m, QuantLinear):
            m.marlin = None
    return count


def group_experts(moe: SparseMoe) -> bool:
    """Stack a MoE layer's experts for the grouped kernel (kernels/w4a16_moe.py) and drop their per-expert copies,
    when every projection is a bias-free Triton W4A16 linear on the K-packed layout with the same bits, groups and
    zero-point kind. Returns whether it did; the layer keeps its per-expert loop otherwise."""
    if moe.grouped is not None or not len(moe.experts):  # stacked already
        return moe.grouped is not None
    parts = [(e.gate_proj, e.up_proj, e.down_proj) for e in moe.experts]
    ok = all(
        isinstance(p, QuantLinear)
        and p.bias is None
        and p.layer.kernel.name == "triton_w4a16"
        and isinstance(p.layer.state, PlainState)
        for trio in parts
        for p in trio
    )
    if not ok:
        return False
    gate_up = stack_experts([[g.layer.state, u.layer.state] for g, u, _ in parts])
    down = stack_experts([[d.layer.state] for _, _, d in parts])
    if gate_up is None or down is None:
        return False
    moe.grouped = (gate_up, down)
    moe.experts = nn.ModuleList()  # the stacked copy is the only one now
    return True
