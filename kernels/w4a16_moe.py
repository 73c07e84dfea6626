"""Grouped W4A16 for a mixture of experts: every expert's GEMM of a layer in one launch (vLLM's fused_moe design).

A MoE layer routes each of T tokens to k of E experts, so it holds S = T k (token, expert) slots. Looping over
the experts costs one launch per chosen expert and a host sync to learn which were chosen; here instead:

1. `align_by_expert` sorts the slots by expert and pads each expert's run to a multiple of BLOCK_M (with the
   sentinel slot S), so that every block of BLOCK_M sorted slots belongs to one expert. It runs on the device with
   fixed shapes (at most S + E (BLOCK_M - 1) entries) and never syncs, so a CUDA graph can hold it.
2. `moe_gemm` launches one program per (block, N tile). A program reads its block's expert, gathers its slots'
   rows of the input (row `slot // k` of the tokens for the first GEMM, row `slot` of the intermediate for the
   second), and runs the K loop of w4a16_plain.py's kernel on that expert's slice of the stacked weight. Blocks
   past the padded total return at once; padding rows are masked.
3. `fused_moe` does gate|up (one GEMM, N = 2 I), silu(gate) * up, down with each slot's routing weight, and the
   sum over each token's k slots. At decode (BLOCK_M = 1) nothing is sorted: each slot is its own block.

The stacked weight (`MoeState`) is the experts' K-packed copies (w4a16_plain.py) laid side by side, [E, K / P, N]
words with [E, n_groups, N] scales and zero points: each expert's weight is stored once and never dequantized.
Act-order experts (a per-expert activation permutation) are not stacked; their layer keeps the per-expert loop.

BLOCK_M is 1 (multiply-adds, no padding) while the slots are no more than the experts, as in decode, where most
experts see one token at most; above that, tensor-core tiles of 16 to 64 rows by the mean slots per expert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .fused import silu_mul, silu_mul_ref
from .w4a16_plain import PlainState

tl: Any = None  # triton.language, bound on first use


@dataclass(frozen=True)
class MoeState:
    """E experts' weights of one projection in the K-packed layout, stacked on a leading expert axis."""

    qweight: torch.Tensor  # int32 [E, K / (32 / bits), N]
    scales: torch.Tensor  # [E, n_groups, N]
    zeros: torch.Tensor | None  # uint8 [E, n_groups, N], or None (symmetric)
    bits: int
    group: int  # rows per group (K for per-channel)
    K: int  # noqa: N815 - GEMM letters
    N: int  # noqa: N815

    @property
    def n_experts(self) -> int:
        return self.qweight.shape[0]


def stack_experts(per_expert: list[list[PlainState]]) -> MoeState | None:
    """Stack each expert's projections, concatenated along N (gate then up), into one MoeState; None when they
    cannot share one launch (act-order, or bits, groups, K or zero points that differ)."""
    flat = [s for parts in per_expert for s in parts]
    first = flat[0]
    for s in flat:
        if s.perm is not None or (s.bits, s.group, s.K) != (first.bits, first.group, first.K):
            return None
        if (s.zeros is None) != (first.zeros is None):
            return None
    if len({sum(s.N for s in parts) for parts in per_expert}) != 1:
        return None

    def stacked(field: str) -> torch.Tensor:
        return torch.stack([torch.cat([getattr(s, field) for s in parts], dim=1) for parts in per_expert])

    return MoeState(
        qweight=stacked("qweight"),
        scales=stacked("scales"),
        zeros=None if first.zeros is None else stacked("zeros"),
        bits=first.bits,
        group=first.group,
        K=first.K,
        N=sum(s.N for s in per_expert[0]),
    )


def choose_block_m(slots: int, n_experts: int) -> int:
    """Rows per block: 1 (no padding, multiply-adds) while there are no more slots than experts, else a tensor-core
    tile sized by the mean slots per expert."""
    if slots <= n_experts:
        return 1
    mean = slots / n_experts
    return 16 if mean <= 16 else 32 if mean <= 48 else 64


def align_by_expert(
    topk_ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots sorted by expert, each expert's run padded to a multiple of block_m.

    Returns (sorted_slots int32 [cap], block_expert int32 [cap / block_m], n_padded int32 [1]); padding entries
    hold the sentinel S = topk_ids.numel(), and blocks at or past n_padded are unused.
    """
    flat = topk_ids.reshape(-1).long()
    s = flat.numel()
    if block_m == 1:  # every slot a block of its own: nothing to sort or pad
        slots = torch.arange(s, dtype=torch.int32, device=flat.device)
        return slots, flat.to(torch.int32), slots.new_full((1,), s)
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(s, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    cap = -(-(s + n_experts * (block_m - 1)) // block_m) * block_m
    sorted_slots = torch.full((cap,), s, dtype=torch.int32, device=flat.device)
    sorted_slots[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, cap, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=n_experts - 1).to(torch.int32)
    return sorted_slots, block_expert, ends[-1:].to(torch.int32)


def _moe_gemm(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, rw_ptr, slots_ptr, expert_ptr, npad_ptr,
    N, K, n_slots, top_k, stride_xm, stride_om, group_size,
    BITS: tl.constexpr, PACK: tl.constexpr, HAS_ZP: tl.constexpr, GATHER_TOKENS: tl.constexpr,
    ROUTED_WEIGHT: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[slot, n] = x[row(slot)] @ W[expert(block)] for the block's slots; PACK = 32 / BITS."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slots < n_slots
    rows = (slots // top_k if GATHER_TOKENS else slots).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // PACK)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = tl.arange(0, PACK) * BITS
    n_groups = (K + group_size - 1) // group_size
    qw_e = qw_ptr + e * (K // PACK) * N
    s_e = s_ptr + e * n_groups * N
    z_e = z_ptr + e * n_groups * N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        wrows = kb * (BLOCK_K // PACK) + offs_w
        words = tl.load(
            qw_e + wrows[:, None] * N + offs_n[None, :],
            mask=(wrows < K // PACK)[:, None] & n_mask[None, :],
            other=0,
        )
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), [BLOCK_K, BLOCK_N])
        g = (kb * BLOCK_K) // group_size
        if HAS_ZP:
            z = tl.load(z_e + g * N + offs_n, mask=n_mask, other=0).to(tl.int32)
            b = q - z[None, :]
        else:
            b = q - (1 << (BITS - 1))
        ks = kb * BLOCK_K + offs_k
        xs = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=m_mask[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        if USE_DOT:
            part = tl.dot(xs, b.to(xs.dtype), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:
            part = tl.reduce(
                xs.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1, tl.standard._sum_combine
            )
        s = tl.load(s_e + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * s[None, :]
    if ROUTED_WEIGHT:
        acc *= tl.load(rw_ptr + slots, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    optrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@functools.cache
def _wrapped(interpret: bool) -> Any:
    global tl
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = triton.language
    return (InterpretedFunction if interpret else JITFunction)(_moe_gemm)


def moe_gemm(
    x: torch.Tensor,
    state: MoeState,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    top_k: int,
    out_rows: int,
    routed_weights: torch.Tensor | None = None,
    interpret: bool = False,
) -> torch.Tensor:
    """[out_rows, N] in x.dtype: row `slot` is x[slot // top_k] @ W[e] (top_k > 0: x holds the tokens) or
    x[slot] @ W[e] (top_k == 0: x holds one row per slot), times routed_weights[slot] when given."""
    sorted_slots, block_expert, n_padded = aligned
    k, n = state.K, state.N
    block_k = next(b for b in (128, 64, 32) if state.group % b == 0 or state.group == k and b == 128)
    if block_m >= 64:
        block_k = min(block_k, 64)
    block_n = 64 if block_m == 1 and n <= 2048 else 128
    # The interpreter truncates fp32 -> bf16 and mishandles bf16 dots (w4a16_plain.py): compute in fp32 there.
    bf16_fix = interpret and x.dtype == torch.bfloat16
    xs = x.float() if bf16_fix else x.contiguous()
    out = torch.empty(out_rows, n, device=x.device, dtype=xs.dtype)  # every slot's row is written once
    rw = routed_weights.reshape(-1).contiguous() if routed_weights is not None else sorted_slots
    dummy = state.qweight
    grid = (sorted_slots.numel() // block_m, -(-n // block_n))
    _wrapped(interpret)[grid](
        xs, state.qweight, state.scales, dummy if state.zeros is None else state.zeros, out, rw,
        sorted_slots, block_expert, n_padded, n, k, out_rows, max(top_k, 1), xs.stride(0), n, state.group,
        BITS=state.bits, PACK=32 // state.bits, HAS_ZP=state.zeros is not None, GATHER_TOKENS=top_k > 0,
        ROUTED_WEIGHT=routed_weights is not None, USE_DOT=block_m > 1,
        DOT_PRECISION="ieee" if xs.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4 if block_m <= 32 else 8, num_stages=3,
    )  # fmt: skip
    return out.to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    gate_up: MoeState,
    down: MoeState,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    interpret: bool = False,
) -> torch.Tensor:
    """A gated-MLP MoE layer: x [T, H] -> [T, H] in x.dtype, sum_j w[t, j] down_e(silu(gate_e x) * up_e x) over
    each token's experts e = topk_ids[t, j] with weights topk_weights[t, j]."""
    t, top_k = topk_ids.shape
    slots = t * top_k
    block_m = choose_block_m(slots, gate_up.n_experts)
    aligned = align_by_expert(topk_ids, gate_up.n_experts, block_m)
    h = moe_gemm(x, gate_up, aligned, block_m, top_k, slots, interpret=interpret)  # [S, 2I]
    act = silu_mul(h) if x.is_cuda else silu_mul_ref(h)  # [S, I]
    y = moe_gemm(act, down, aligned, block_m, 0, slots, topk_weights.to(torch.float32), interpret)  # [S, H]
    return y.view(t, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """fp32 loop over tokens and their experts with dense weights gate_up [E, H, 2I] and down [E, I, H]."""
    x = x.float()
    out = torch.zeros(x.shape[0], down.shape[-1], dtype=torch.float32)
    inter = gate_up.shape[-1] // 2
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t].tolist(), topk_weights[t].float().tolist(), strict=True):
            h = x[t] @ gate_up[e].float()
            out[t] += w * ((torch.nn.functional.silu(h[:inter]) * h[inter:]) @ down[e].float())
    return out
