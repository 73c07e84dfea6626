"""The calibration driver's per-layer step, RTN and GPTQ (AWQ's is awq_block.py): quantize the linears of a decoder
block in place (seven in a dense block; in a mixture of experts the four of attention and three per expert (and the
shared expert's), the router left dense). Qwen3.5's Gated DeltaNet layers have no attention linears: their MLP is quantized, and their own
projections are left dense unless asked for (`QuantizeOptions.deltanet`, the `in_proj_qkv`, `in_proj_z` and
`out_proj`; `in_proj_a` and `in_proj_b`, one output per value head, always stay dense), as the published Qwen3.5
recipes keep them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from quantserve.backends.torch.deltanet import QUANTIZABLE
from quantserve.backends.torch.model import ModelArgs, Rope, TransformerBlock
from quantserve.converters.calibration.gptq import GPTQ
from quantserve.errors import ConfigError
from quantserve.kernels.qweight import QuantizedWeight
from quantserve.quant.rtn import check_quant_args, quantize_rtn

METHODS = (
    "rtn",
    "gptq",
    "awq",
    "awq-gptq",
)  # the per-layer steps: here (rtn, gptq), awq_block.py (awq); convert's too
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
    method: str  # one of METHODS
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
        if self.method not in METHODS:
            raise ConfigError(f"unknown quantization method {self.method!r}; use one of {', '.join(METHODS)}")
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


def set_dequantized(block: nn.Module, name: str, qw: QuantizedWeight) -> None:
    block.get_submodule(name).weight.copy_(qw.dequantize().t())


def quantize_block_rtn(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> LayerResult:
    out: LayerResult = {}
    for name in block_linears(block):
        w = block.get_submodule(name).weight
        out[name] = quantize_rtn(w, *opt.bits_for(name), opt.sym, opt.scale_dtype, name), None
        set_dequantized(block, name, out[name][0])
    return out


def quantize_block_gptq(block: TransformerBlock, hidden, rope, opt: QuantizeOptions) -> LayerResult:
    out: LayerResult = {}
    for group in sequential_groups(block) if opt.true_sequential else (block_linears(block),):
        hooked = sorted({same_input(n) for n in group})
        gptq = {n: GPTQ(block.get_submodule(n).in_features) for n in hooked}
        capture(block, hidden, rope, hooked, lambda n, x, gptq=gptq: gptq[n].add_batch(x), opt.batch_size)
        # the linears that read one input at one setting share a column sweep (q|k|v, gate|up)
        sweeps: dict[tuple[str, tuple[int, int]], list[str]] = {}
        for name in group:
            sweeps.setdefault((same_input(name), opt.bits_for(name)), []).append(name)
        keys = list(sweeps)
        for i, ((src, (bits, group_size)), names) in enumerate(sweeps.items()):
            results = gptq[src].fasterquant_all(
                [block.get_submodule(n).weight for n in names], bits, group_size, opt.sym, opt.act_order,
                opt.damp_percent, static_groups=opt.static_groups, scale_dtype=opt.scale_dtype,
                name=", ".join(names), keep_hessian=any(s == src for s, _ in keys[i + 1 :]),
            )  # fmt: skip
            for name, r in zip(names, results, strict=True):
                out[name] = r.weight, r.loss
                block.get_submodule(name).weight.copy_(r.wq)
    return out
