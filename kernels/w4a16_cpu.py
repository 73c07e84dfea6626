"""CPU W4A16 without Triton: unpack the Marlin layout once, then per call dequantize (or read a dense copy) and matmul.

Both kernels compute in fp32 whatever the activation dtype (fp16/bf16 x is widened exactly, the output rounded
once), so they agree with the fp32 reference to ~1e-7. Trade-offs, per layer of K x N weights (4-bit packed
Marlin is K*N/2 bytes):

* CpuDequantKernel keeps int8 `q - zero` [N, K] (K*N bytes, int16 for asymmetric 8-bit) plus fp32 scales, and
  each call builds a transient fp32 [N, K] (4*K*N bytes, freed after the call): one conversion pass and one
  scale pass over the weight before the matmul, ~3-10x slower than a dense matmul at M = 1.
* CpuDenseKernel keeps the dequantized fp32 [N, K] resident (4*K*N bytes, 8x the packed size): a plain
  matmul per call, the fastest CPU option, and the memory of an fp32 model.

Measured with bench/w4a16_gemm.py --cpu-bench (AMD EPYC, 1 thread, group 64; ms per call):

    layer (K x N)   M   cpu_dequant  cpu_dense
    576 x 1536      1   0.145        0.053
    1536 x 576      1   0.139        0.049
    576 x 1536      64  1.62         1.52
    1536 x 576      64  1.73         1.50

SmolLM2-135M's quantized linears (30 layers x 7) then cost ~18 ms (dequant) / ~6.5 ms (dense) per decoded
token: both usable; at prefill (M = 64) the dequant pass is mostly hidden behind the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .marlin import MarlinWeight, marlin_unpack, marlin_unpack_zero_points, marlin_unpermute_scales

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CpuW4A16State:
    """One layer unpacked for the CPU. Input columns stay in Marlin's packed (group-sorted) order, so act-order
    costs one index_select of x per call and the groups of GPTQ act-order stay contiguous."""

    qc: torch.Tensor | None  # int8/int16 [N, K]: q - zero (dequant kernel), packed column order
    scales: torch.Tensor | None  # fp32 [N, n_groups]
    col_group: torch.Tensor | None  # int64 [K]: group of each packed column, only when groups are uneven
    group: int  # length of every group in packed order; 0 when uneven (use col_group)
    perm: torch.Tensor | None  # int64 [K]: x column read by packed column k (act-order)
    dense: torch.Tensor | None  # fp32 [N, K] dequantized, natural order (dense kernel)
    K: int  # noqa: N815 - GEMM letters
    N: int  # noqa: N815


def _check_cpu(mw: MarlinWeight, x_dtype: torch.dtype, device: torch.device | str) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type != "cpu":
        return False, f"device {device} (this kernel runs on CPU tensors only)"
    if x_dtype not in _FLOATS:
        return False, f"activations {x_dtype} (needs float16, bfloat16 or float32)"
    if mw.bits not in (4, 8):
        return False, f"{mw.bits}-bit weights (the Marlin layout holds 4- or 8-bit)"
    if mw.K % 16 or mw.N % 64:
        return False, f"K={mw.K}, N={mw.N}: Marlin tiles need K % 16 == 0 and N % 64 == 0"
    return True, ""


def unpack_for_cpu(mw: MarlinWeight) -> CpuW4A16State:
    """Undo the Marlin tiling and the scale / zero-point permutations once (packed row order kept)."""
    k, n, bits = mw.K, mw.N, mw.bits
    group = k if mw.group_size == -1 else mw.group_size
    q = marlin_unpack(mw.qweight.cpu(), k, n, bits)  # uint8 [K, N], packed row order
    scales = marlin_unpermute_scales(mw.scales.cpu().float(), k, n, mw.group_size)  # [n_groups, N]
    g = mw.g_idx.cpu().long() if mw.g_idx is not None else torch.arange(k) // group  # sorted
    if mw.zeros is not None:
        zeros = marlin_unpack_zero_points(mw.zeros.cpu(), k, n, bits).to(torch.int16)[g]  # [K, N]
    else:
        zeros = torch.full((1, n), 1 << (bits - 1), dtype=torch.int16)
    small = bits == 4 or mw.zeros is None  # q - zero fits int8 except for asymmetric 8-bit
    qc = (q.to(torch.int16) - zeros).to(torch.int8 if small else torch.int16).t().contiguous()
    uniform = k % group == 0 and torch.equal(g, torch.arange(k) // group)
    return CpuW4A16State(
        qc=qc,
        scales=scales.t().contiguous(),
        col_group=None if uniform else g,
        group=group if uniform else 0,
        perm=None if mw.perm is None else mw.perm.cpu().long(),
        dense=None,
        K=k,
        N=n,
    )


def dequantize_cpu(state: CpuW4A16State) -> torch.Tensor:
    """fp32 [N, K] in packed column order: q - zero widened, times the scale of its group (a fresh tensor)."""
    w = state.qc.to(torch.float32)
    if state.group:
        n_groups = state.K // state.group
        return w.view(state.N, n_groups, state.group).mul_(state.scales[:, :, None]).view(state.N, state.K)
    return w.mul_(state.scales.index_select(1, state.col_group))


def _linear(x: torch.Tensor, w: torch.Tensor, perm: torch.Tensor | None, bias: torch.Tensor | None, k: int):
    if x.shape[-1] != k:
        raise ValueError(f"W4A16 linear: x has {x.shape[-1]} input features, the weight has K={k}")
    x2 = x.reshape(-1, k).float()
    if perm is not None:
        x2 = x2.index_select(1, perm)
    out = F.linear(x2, w, None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


class CpuDequantKernel:
    """int8 `q - zero` resident (K*N bytes), dequantized to a transient fp32 weight on every call."""

    name = "cpu_dequant"

    @classmethod
    def can_implement(
        cls, mw: MarlinWeight, x_dtype: torch.dtype, device: torch.device | str
    ) -> tuple[bool, str]:
        return _check_cpu(mw, x_dtype, device)

    def prepare(self, mw: MarlinWeight) -> CpuW4A16State:
        return unpack_for_cpu(mw)

    def apply(self, state: CpuW4A16State, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(x, dequantize_cpu(state), state.perm, bias, state.K)


class CpuDenseKernel(CpuDequantKernel):
    """fp32 dequantized weight resident (4*K*N bytes, 8x the packed 4-bit size): fastest on CPU, most memory.
    Runs what cpu_dequant runs (same can_implement); only prepare and apply differ."""

    name = "cpu_dense"

    def prepare(self, mw: MarlinWeight) -> CpuW4A16State:
        s = unpack_for_cpu(mw)
        dense = dequantize_cpu(s)
        if s.perm is not None:  # back to natural column order, so x needs no gather per call
            natural = torch.empty_like(dense)
            natural[:, s.perm] = dense
            dense = natural
        return CpuW4A16State(None, None, None, 0, None, dense, s.K, s.N)

    def apply(self, state: CpuW4A16State, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(x, state.dense, None, bias, state.K)
