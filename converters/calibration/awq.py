"""AWQ (Lin et al. 2023): activation-aware per-channel scale search, clipping search, and AWQ's quantizer.

The algorithm follows llm-awq / AutoAWQ (awq/quantize/quantizer.py) in words: for linears sharing an input x,
try s = mean|x|^α for α on a grid in [0, 1), normalised by sqrt(max(s)·min(s)), and keep the s whose quantized
W·diag(s) applied to x/s best reproduces the block's output. The scales are then folded into the op that
produces x (an RMSNorm weight or the previous linear's rows; `apply_scale`), so the model is unchanged until
the weights are rounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from quantserve.kernels.qweight import QuantizedWeight
from quantserve.quant.rtn import (
    GroupQuantizer,
    check_quant_args,
    fake_quantize,
    quantize_groups,
    to_quantized_weight,
)

# module_fn(x, weights) -> output: the block that consumes the linears, run with the given [N_i, K] weights.
ModuleFn = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]

_CHUNK_ELEMENTS = 1 << 24  # rows of x per module_fn call, so attention over many samples stays in memory


@dataclass(frozen=True)
class AWQQuantizer(GroupQuantizer):
    """AWQ's min/max quantizer (docs/quantized-checkpoints.md, "AWQ quantizer"): unlike GPTQ's, the range is
    not widened to include 0.

    sym=False (AutoAWQ zero_point=True): scale = max(max - min, 1e-5)/maxq, zero = clamp(-round(min/scale)).
    sym=True (zero_point=False): scale = max|w|/(2^(b-1) - 1), zero 2^(b-1).
    """

    def find_params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sym:
            half = 1 << (self.bits - 1)
            scale = self.round_scale(w.abs().amax(-1, keepdim=True).clamp(min=1e-5) / (half - 1))
            return scale, torch.full_like(scale, half)
        wmax, wmin = w.amax(-1, keepdim=True), w.amin(-1, keepdim=True)
        scale = self.round_scale((wmax - wmin).clamp(min=1e-5) / self.maxq)
        return scale, (-torch.round(wmin / scale)).clamp(0, self.maxq)


def _chunks(x: torch.Tensor) -> Iterator[torch.Tensor]:
    per_row = max(1, x[0].numel()) if x.dim() > 1 else 1
    step = max(1, _CHUNK_ELEMENTS // per_row)
    yield from x.split(step, dim=0)


def search_scale(
    x: torch.Tensor,
    linears: Sequence[torch.Tensor],
    module_fn: ModuleFn,
    bits: int = 4,
    group_size: int = 128,
    grid: int = 20,
    sym: bool = False,
    duo_scaling: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """The per-input-channel scale s [K] (float32) that best protects the linears' salient channels.

    Args:
        x: [..., K] the linears' shared input over the calibration set, split along dim 0 into module_fn
            calls (so keep whole sequences in dim 0 when module_fn is attention).
        linears: weights [N_i, K] that read x (e.g. q/k/v, or gate/up).
        module_fn: f(x, weights) -> output of the block that contains them; the loss is
            mean (f([Q(W_i·diag(s))/s], x) − f(W, x))², i.e. quantized W·diag(s) applied to x/s.
        grid: number of α values i/grid, i = 0..grid-1 (α = 0 is s = 1, plain round-to-nearest).
        duo_scaling: AutoAWQ's variant s = mean|x|^α / mean(w-magnitude)^(1-α); the original uses mean|x|^α.
    """
    k = x.shape[-1]
    g = check_quant_args(k, bits, group_size)
    quantizer = AWQQuantizer(bits, sym, scale_dtype)
    ws = [w.detach().float() for w in linears]
    x_mean = torch.zeros(k, device=x.device)
    rows = 0
    for c in _chunks(x.reshape(-1, k)):
        x_mean += c.abs().float().sum(0)
        rows += c.shape[0]
    x_mean /= max(rows, 1)
    w_mean = None
    if duo_scaling:
        wcat = torch.cat(ws).reshape(-1, g).abs()
        w_mean = (wcat / (wcat.amax(1, keepdim=True) + 1e-6)).reshape(-1, k).mean(0)
    reference = [module_fn(c, ws) for c in _chunks(x)]

    best_loss, best = float("inf"), torch.ones(k, device=x.device)
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha)
        if w_mean is not None:
            s = s / (w_mean.pow(1 - alpha) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        trial = [fake_quantize(w * s, quantizer, group_size) / s for w in ws]
        loss = sum(
            float((module_fn(c, trial) - ref).float().pow(2).sum())
            for c, ref in zip(_chunks(x), reference, strict=True)
        )
        if loss < best_loss:
            best_loss, best = loss, s
    return best


def apply_scale(
    prev: torch.Tensor,
    linears: Sequence[torch.Tensor],
    s: torch.Tensor,
    prev_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """Fold s into the op producing the linears' input: (prev / s, [W_i · diag(s)], prev_bias / s).

    prev is an RMSNorm weight [K] or the previous linear's weight [K, *] (its output rows: v_proj for o_proj,
    up_proj for down_proj); since x' = x / s and W' = W·diag(s), W'x' = Wx and the model is unchanged.
    """
    s = s.to(prev.device, torch.float32)
    new_prev = prev.float() / (s if prev.dim() == 1 else s[:, None])
    new_bias = None if prev_bias is None else prev_bias.float() / s
    return new_prev, [w.float() * s[None, :] for w in linears], new_bias


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    sym: bool = False,
    scale_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """max_val [N, n_groups]: per group, the clipping threshold in {max|w|·(1 − i/n_grid)} that minimises that
    group's output error mean_t (x_g·(Q(clip(w_g)) − w_g))² over ≤ n_tokens evenly spaced tokens of x.
    i runs over [0, max_shrink·n_grid) (i = 0: no clipping), as AutoAWQ's search."""
    n, k = w.shape
    g = check_quant_args(k, bits, group_size)
    quantizer = AWQQuantizer(bits, sym, scale_dtype)
    xt = x.reshape(-1, k)
    xt = xt[:: max(1, xt.shape[0] // n_tokens)].float().reshape(-1, k // g, g)  # [T, ng, G]
    w3 = w.detach().float().reshape(n, k // g, g)
    out = []
    # Per-group outputs by one batched matmul over groups ([ob, T, ng]), not AutoAWQ's [ob, T, ng, G] product.
    ob = max(1, (1 << 24) // max(1, xt.shape[0] * xt.shape[1]))
    for wb in w3.split(ob, dim=0):
        org_max = wb.abs().amax(-1)  # [ob, ng]
        ref = torch.einsum("tgk,ogk->otg", xt, wb)
        best, best_err = org_max.clone(), torch.full_like(org_max, float("inf"))
        for i in range(int(max_shrink * n_grid)):
            mv = (org_max * (1 - i / n_grid))[..., None]
            cur = wb.clamp(-mv, mv)
            sc, zr = quantizer.find_params(cur)
            qw = quantizer.dequantize(quantizer.quantize(cur, sc, zr), sc, zr)
            err = (torch.einsum("tgk,ogk->otg", xt, qw) - ref).pow(2).mean(1)  # [ob, ng]
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, mv[..., 0], best)
        out.append(best)
    return torch.cat(out)


def apply_clip(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """w [N, K] clamped per group to [-max_val, max_val] (max_val [N, n_groups]); float32."""
    n, k = w.shape
    mv = max_val.float()[..., None]
    return w.float().reshape(n, mv.shape[1], -1).clamp(-mv, mv).reshape(n, k)


def quantize_awq(
    w: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    zero_point: bool = True,
    scale_dtype: torch.dtype = torch.float16,
    name: str = "weight",
) -> QuantizedWeight:
    """Quantize an AWQ-scaled (and clipped) weight w [N, K] with AWQ's quantizer; returns GEMM-oriented
    [K, N].

    zero_point True is AutoAWQ's default asymmetric 4-bit (zeros stored); False is its symmetric variant.

    Raises:
        ConfigError: bad bits/group_size, or K not a multiple of group_size.
    """
    quantizer = AWQQuantizer(bits, not zero_point, scale_dtype)
    q, scale, zero = quantize_groups(w, quantizer, group_size, name)
    return to_quantized_weight(q, scale, zero, quantizer, group_size)
