"""AWQ's scales for a block whose checkpoint fuses q|k|v and gate|up (Phi-3 / Phi-4; awq_block.py's awq_scale_block
hands such a block over here), as AutoAWQ's Phi-3 recipe groups them: input_layernorm → qkv_proj; v's rows of
qkv_proj → o_proj (without GQA only: v's outputs must be o's inputs one to one); post_attention_layernorm →
gate_up_proj; up's rows of gate_up_proj → down_proj (down reads act(gate) · up, so scaling up's rows scales it)."""

from __future__ import annotations

import torch
from torch.func import functional_call

from quantserve.backends.torch.model import TransformerBlock
from quantserve.converters.calibration.awq_block import linear_fn, scale_searcher
from quantserve.converters.calibration.layers import FUSED_LINEARS, QuantizeOptions, capture
from quantserve.errors import ConfigError


def _fold(prev: torch.Tensor, rows: int, linear: torch.Tensor, s: torch.Tensor) -> None:
    """prev's last `rows` output rows (or a norm's weight, rows 0) / s, and linear's input columns · s."""
    s = s.to(prev.device, torch.float32)
    if rows:
        prev[-rows:].copy_(prev[-rows:].float() / s[:, None])
    else:
        prev.copy_(prev.float() / s)
    linear.copy_(linear.float() * s[None, :])


def awq_scale_fused_block(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> dict:
    """The four scales, searched and folded into the block in place (its function is unchanged until the weights
    are rounded). Returns, per linear, (its captured input, the scale that input is now divided by, or None)."""
    attn, mlp = block.self_attn, block.mlp
    if attn.qkv_proj.bias is not None:  # v's bias would have to be divided too (Phi-3/4 have none)
        raise ConfigError("awq on a fused q|k|v with a bias is not supported; use --quant gptq or rtn")
    feats: dict[str, list[torch.Tensor]] = {}
    capture(
        block, hidden, rope, FUSED_LINEARS, lambda n, x: feats.setdefault(n, []).append(x), opt.batch_size
    )
    x_qkv, x_o, x_mlp, x_down = (torch.cat(feats.pop(n)) for n in FUSED_LINEARS)
    search = scale_searcher(opt)

    def attn_fn(x: torch.Tensor, ws) -> torch.Tensor:
        return functional_call(attn, {"qkv_proj.weight": ws[0]}, (x, rope))

    def mlp_fn(x: torch.Tensor, ws) -> torch.Tensor:
        return functional_call(mlp, {"gate_up_proj.weight": ws[0]}, (x,))

    s_qkv = search(x_qkv, [attn.qkv_proj.weight], attn_fn)
    n_o = attn.o_proj.in_features
    v_rows = attn.qkv_sizes[2]  # q|k|v: v's rows last
    s_o = search(x_o, [attn.o_proj.weight], linear_fn) if v_rows == n_o else None
    s_mlp = search(x_mlp, [mlp.gate_up_proj.weight], mlp_fn)
    s_down = search(x_down, [mlp.down_proj.weight], linear_fn)
    _fold(block.input_layernorm.weight, 0, attn.qkv_proj.weight, s_qkv)
    if s_o is not None:
        _fold(attn.qkv_proj.weight, n_o, attn.o_proj.weight, s_o)
    _fold(block.post_attention_layernorm.weight, 0, mlp.gate_up_proj.weight, s_mlp)
    _fold(mlp.gate_up_proj.weight, mlp.down_proj.in_features, mlp.down_proj.weight, s_down)
    return {
        "self_attn.qkv_proj": (x_qkv, s_qkv),
        "self_attn.o_proj": (x_o, s_o),
        "mlp.gate_up_proj": (x_mlp, s_mlp),
        "mlp.down_proj": (x_down, s_down),
    }
