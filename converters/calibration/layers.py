"""The calibration driver's per-layer step: quantize the linears of a decoder block in place (seven in a dense
block; in a mixture of experts the four of attention and three per expert (and the shared expert's), the router
left dense). Qwen3.5's Gated DeltaNet layers have no attention linears: their MLP is quantized, and their own
projections are left dense unless asked for (`QuantizeOptions.deltanet`, the `in_proj_qkv`, `in_proj_z` and
`out_proj`; `in_proj_a` and `in_proj_b`, one output per value head, always stay dense), as the published Qwen3.5
recipes keep them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from quantserve.backends.torch.deltanet import QUANTIZABLE
from quantserve.backends.torch.model import ModelArgs, Rope, TransformerBlock
from quantserve.converters.calibration.awq import (
    apply_clip,
    apply_scale,
    quantize_awq,
    search_clip,
    search_scale,
)
from quantserve.converters.calibration.gptq import GPTQ
from quantserve.errors import ConfigError
from quantserve.kernels.qweight import QuantizedWeight
from quantserve.quant.rtn import check_quant_args, quantize_rtn

LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
# GPTQ's true-sequential order (reference llama.py): each group sees the quantized output of the ones before.
SEQUENTIAL = (LINEARS[:3], LINEARS[3:4], LINEARS[4:6], LINEARS[6:])
# Linears that read the same tensor as another share its Hessian / captured input.
SAME_INPUT = {
    "self_attn.k_proj": "self_attn.q_proj",
    "self_attn.v_proj": "self_attn.q_proj",
    "mlp.up_proj": "mlp.gate_proj",
    "mlp.shared_expert.up_proj": "mlp.shared_expert.gate_proj",
    "linear_attn.in_proj_z": "linear_attn.in_proj_qkv",
}
# AutoAWQ does not clip q/k: small errors there are amplified by the attention softmax. Phi-3's fused q|k|v is
# left unclipped for the same reason (AutoAWQ's name filter misses `qkv_proj` and clips it).
AWQ_NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.qkv_proj")
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoint fuses q|k|v and gate|up: four linears, each its own sequential group
FUSED_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# A Gated DeltaNet's projections that may be quantized (with QuantizeOptions.deltanet), in sequential order
DELTANET_LINEARS = tuple(f"linear_attn.{p}" for p in QUANTIZABLE)
SHARED_EXPERT = tuple(f"mlp.shared_expert.{p}" for p in EXPERT_LINEARS)  # Qwen3.5-MoE


def fused(block: nn.Module) -> bool:
    return getattr(getattr(block, "self_attn", None), "qkv_proj", None) is not None


def n_experts(block: nn.Module) -> int:
    experts = getattr(block.mlp, "experts", None)
    return len(experts) if experts is not None else 0


def deltanet(block: nn.Module) -> bool:
    return getattr(block, "linear", False)


def mixer_linears(block: nn.Module) -> tuple[str, ...]:
    """The quantized linears of the block's token mixer: attention's four, a DeltaNet's three when they are to
    be quantized (empty_block's `quantize_deltanet`), or none."""
    if deltanet(block):
        return DELTANET_LINEARS if getattr(block, "quantize_deltanet", False) else ()
    return LINEARS[:4]


def block_linears(block: nn.Module) -> tuple[str, ...]:
    """The quantized linears of a block, in order (a router, `mlp.gate`, is not one of them)."""
    if fused(block):
        return FUSED_LINEARS
    if not n_experts(block):
        return mixer_linears(block) + LINEARS[4:]
    experts = tuple(f"mlp.experts.{e}.{p}" for e in range(n_experts(block)) for p in EXPERT_LINEARS)
    return mixer_linears(block) + experts + (SHARED_EXPERT if block.mlp.shared else ())


def sequential_groups(block: nn.Module) -> tuple[tuple[str, ...], ...]:
    """SEQUENTIAL for the block: q|k|v then o (a DeltaNet's qkv|z then out_proj), then the MLP's gate|up and its
    down; a MoE's experts go in two groups, every gate|up (the shared expert's too), then every down."""
    if fused(block):
        return tuple((name,) for name in FUSED_LINEARS)
    mixer = mixer_linears(block)
    groups = (mixer[:-1], mixer[-1:]) if mixer else ()
    mlp = block_linears(block)[len(mixer) :]
    return groups + (tuple(n for n in mlp if not n.endswith("down_proj")),
                     tuple(n for n in mlp if n.endswith("down_proj")))  # fmt: skip


def same_input(name: str) -> str:
    """The linear whose input `name` reads too (itself if none): an expert's up_proj reads its gate_proj's."""
    if name.startswith("mlp.experts.") and name.endswith(".up_proj"):
        return name.removesuffix("up_proj") + "gate_proj"
    return SAME_INPUT.get(name, name)


LayerResult = dict[str, tuple[QuantizedWeight, float | None]]


@dataclass(frozen=True)
class QuantizeOptions:
    method: str  # a key of LAYER_METHODS
    bits: int
    group_size: int
    sym: bool
    act_order: bool
    damp_percent: float = 0.01
    static_groups: bool = False
    true_sequential: bool = True
    duo_scaling: bool = False
    scale_dtype: torch.dtype = torch.float16
    batch_size: int = 8
    # Per-linear (bits, group_size) by full prefix (model.layers.28.mlp.down_proj): a mixed-precision recipe.
    overrides: tuple[tuple[str, tuple[int, int]], ...] = ()
    layer: int = 0  # the decoder layer being quantized (set by the driver)
    deltanet: bool = False  # quantize the Gated DeltaNets' in_proj_qkv, in_proj_z and out_proj too (Qwen3.5)

    @property
    def calibrated(self) -> bool:
        return self.method != "rtn"

    def bits_for(self, name: str) -> tuple[int, int]:
        """(bits, group_size) for the linear `name` (self_attn.q_proj) of the current layer."""
        return dict(self.overrides).get(f"model.layers.{self.layer}.{name}", (self.bits, self.group_size))

    def check(self, args: ModelArgs) -> None:
        """Raises ConfigError for an unknown method or options that cannot apply to this model's shapes."""
        if self.method not in LAYER_METHODS:
            raise ConfigError(
                f"unknown quantization method {self.method!r}; use one of {', '.join(LAYER_METHODS)}"
            )
        if self.method == "awq" and self.act_order:
            raise ConfigError("AWQ has no act-order; drop --act-order or use --method gptq")
        if not 0 < self.damp_percent <= 1 or self.batch_size < 1:
            raise ConfigError(
                f"need 0 < damp_percent <= 1 and batch_size >= 1; got {self.damp_percent}, {self.batch_size}"
            )
        if self.deltanet and not args.deltanet:
            raise ConfigError("--quantize-deltanet applies to models with Gated DeltaNet layers (Qwen3.5); "
                              "this one has none")  # fmt: skip
        for name, k in self._input_sizes(args).items():
            check_quant_args(k, self.bits, self.group_size, name)
        for prefix, (bits, group) in self.overrides:
            kind = prefix.rsplit(".", 1)[-1]
            k = self._input_sizes(args).get(kind, args.hidden_size)
            if "shared_expert." in prefix and kind == "down_proj":
                k = args.shared_expert_size
            check_quant_args(k, bits, group, prefix)

    def _input_sizes(self, args: ModelArgs) -> dict[str, int]:
        """K of each kind of quantized linear (by its last name) that does not read the hidden state."""
        sizes = {"q/k/v/gate/up_proj": args.hidden_size, "o_proj": args.num_attention_heads * args.head_dim,
                 "down_proj": args.moe_intermediate_size if args.num_experts else args.intermediate_size}  # fmt: skip
        if args.shared_expert_size:
            sizes["shared_expert.down_proj"] = args.shared_expert_size
        if self.deltanet:
            _, n_v, _, d_v, _ = args.deltanet
            sizes["out_proj"] = n_v * d_v
        return sizes


class _Stop(Exception):
    """Raised by a hook once every input of interest is captured: the rest of the block need not run."""


def run_block(
    block: nn.Module,
    hidden: torch.Tensor,
    rope: Rope,
    batch_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """block(hidden) over [n, T, D] in batches of samples; `out` may be `hidden` (samples are independent)."""
    out = torch.empty_like(hidden) if out is None else out
    for s in range(0, hidden.shape[0], batch_size):
        out[s : s + batch_size] = block(hidden[s : s + batch_size], rope)
    return out


def capture(
    block: nn.Module,
    hidden: torch.Tensor,
    rope: Rope,
    names: Iterable[str],
    sink: Callable[[str, torch.Tensor], None],
    batch_size: int,
) -> None:
    """Run the block over the calibration batches, handing each named linear's input to sink(name, x)."""
    names = set(names)
    fired: set[str] = set()

    def hook(name: str, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        sink(name, args[0])
        fired.add(name)
        if fired == names:
            raise _Stop

    handles = [block.get_submodule(n).register_forward_hook(partial(hook, n)) for n in names]
    try:
        for s in range(0, hidden.shape[0], batch_size):
            fired.clear()
            with contextlib.suppress(_Stop):
                block(hidden[s : s + batch_size], rope)
    finally:
        for h in handles:
            h.remove()


def _set(block: nn.Module, name: str, qw: QuantizedWeight) -> None:
    block.get_submodule(name).weight.copy_(qw.dequantize().t())


def quantize_block_rtn(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> LayerResult:
    out: LayerResult = {}
    for name in block_linears(block):
        w = block.get_submodule(name).weight
        out[name] = quantize_rtn(w, *opt.bits_for(name), opt.sym, opt.scale_dtype, name), None
        _set(block, name, out[name][0])
    return out


def quantize_block_gptq(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> LayerResult:
    out: LayerResult = {}
    for group in sequential_groups(block) if opt.true_sequential else (block_linears(block),):
        hooked = sorted({same_input(n) for n in group})
        gptq = {n: GPTQ(block.get_submodule(n).in_features) for n in hooked}
        capture(block, hidden, rope, hooked, lambda n, x, gptq=gptq: gptq[n].add_batch(x), opt.batch_size)
        for name in group:
            src = same_input(name)
            last = all(same_input(m) != src for m in group[group.index(name) + 1 :])
            r = gptq[src].fasterquant(
                block.get_submodule(name).weight, *opt.bits_for(name), opt.sym, opt.act_order,
                opt.damp_percent, static_groups=opt.static_groups, scale_dtype=opt.scale_dtype, name=name,
                keep_hessian=not last,
            )  # fmt: skip
            out[name] = r.weight, r.loss
            block.get_submodule(name).weight.copy_(r.wq)
    return out


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
        _set(block, name, out[name][0])
    return out


def quantize_block_awq_gptq(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> LayerResult:
    """AWQ's scales, then GPTQ's rounding of the scaled weights against the scaled inputs' Hessians (the two
    stack: AWQ protects salient input channels, GPTQ compensates each rounding error in the columns after it).
    AWQ's clipping is left out: GPTQ's error feedback would undo most of it."""
    awq_scale_block(block, hidden, rope, opt)  # its captured inputs are the unscaled ones: GPTQ recaptures
    return quantize_block_gptq(block, hidden, rope, opt)


# Register, don't elif: a new method is one more entry.
LAYER_METHODS: dict[str, Callable[..., LayerResult]] = {
    "rtn": quantize_block_rtn,
    "gptq": quantize_block_gptq,
    "awq": quantize_block_awq,
    "awq-gptq": quantize_block_awq_gptq,
}
