"""AWQ's scales for a mixture-of-experts block (awq_block.py's awq_scale_block hands such a block over here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from quantserve.backends.torch.model import TransformerBlock
from quantserve.converters.calibration.awq_block import (
    fold_scales,
    linear_fn,
    mixer_hooks,
    mixer_scales,
    scale_searcher,
)
from quantserve.converters.calibration.layers import QuantizeOptions, capture

SHARED_DOWN = "mlp.shared_expert.down_proj"


def awq_scale_moe_block(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> dict:
    """AWQ's scales for a mixture of experts, as AutoAWQ's Qwen3-MoE and Mixtral recipes group them: q|k|v and
    o as in a dense block; one scale shared by every expert's gate and up (they all read the post-attention
    norm, which it is folded into), searched against the whole sparse block's output; and each expert's down
    scaled against its own up. The router reads that norm too: its columns are multiplied by the shared scale
    (it stays dense), so it routes exactly as before. The gate|up scale is searched on every calibration token
    (each expert sees them all while calibrating, calibrate_all), a down's on the tokens routed to its expert
    only, as AutoAWQ keeps them (which also bounds what is held to the routed tokens).

    Qwen3.5-MoE's shared expert reads that norm too: its gate and up join the shared scale's search and folding,
    its gate (`shared_expert_gate`, dense) takes the scale on its columns like the router, and its down is scaled
    against its own up, on every token. The token mixer's scales are awq_block.py's (attention, or a DeltaNet)."""
    mlp = block.mlp
    experts = list(mlp.experts)
    downs = tuple(f"mlp.experts.{e}.down_proj" for e in range(len(experts)))
    feats: dict[str, list[torch.Tensor]] = {}
    routed: list[torch.Tensor] = []  # the current batch's chosen experts [N, k]: the router runs first

    def sink(name: str, x: torch.Tensor) -> None:
        if name == "mlp.gate":  # (inside the router's own hook: its logits recomputed, not the module called)
            routed[:] = [mlp.choose(F.linear(x.reshape(-1, x.shape[-1]), mlp.gate.weight))[0]]
            name = "x_mlp"
        elif name in downs and name != SHARED_DOWN:  # (the shared expert's down reads every token)
            x = x.reshape(-1, x.shape[-1])[(routed[0] == downs.index(name)).any(-1)]
        feats.setdefault(name, []).append(x)

    if mlp.shared:
        experts.append(mlp.shared_expert)
        downs += (SHARED_DOWN,)
    hooked = (*mixer_hooks(block), "mlp.gate", *downs)
    capture(block, hidden, rope, hooked, sink, opt.batch_size)
    x_mlp = torch.cat(feats.pop("x_mlp"))
    x_downs = [torch.cat(feats.pop(n)) for n in downs]

    owners = [
        d.removeprefix("mlp.").removesuffix("down_proj") for d in downs
    ]  # "experts.3.", "shared_expert."
    gate_up = [f"{o}{p}.weight" for o in owners for p in ("gate_proj", "up_proj")]

    def moe_fn(x: torch.Tensor, ws) -> torch.Tensor:
        return functional_call(mlp, dict(zip(gate_up, ws, strict=True)), (x,))

    search = scale_searcher(opt)
    folds, inputs = mixer_scales(block, feats, rope, search)
    s_mlp = search(x_mlp, [mlp.get_parameter(n) for n in gate_up], moe_fn)
    s_downs = [
        search(x, [ex.down_proj.weight], linear_fn)
        if x.shape[0]
        else torch.ones(x.shape[-1], device=x.device)
        for x, ex in zip(x_downs, experts, strict=True)
    ]  # an expert no calibration token reaches keeps its weights as they are
    up_and_gate = [m for ex in experts for m in (ex.gate_proj, ex.up_proj)]
    routers = [mlp.gate, mlp.shared_expert_gate] if mlp.shared else [mlp.gate]
    fold_scales(
        [
            *folds,
            (block.post_attention_layernorm, None, [*up_and_gate, *routers], s_mlp),
            *((ex.up_proj, None, [ex.down_proj], s) for ex, s in zip(experts, s_downs, strict=True)),
        ]
    )
    for owner, x, s in zip(owners, x_downs, s_downs, strict=True):
        inputs |= {f"mlp.{owner}gate_proj": (x_mlp, s_mlp), f"mlp.{owner}up_proj": (x_mlp, s_mlp)}
        inputs[f"mlp.{owner}down_proj"] = (x, s)
    return inputs
