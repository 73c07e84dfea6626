"""vLLM's gptq_marlin / awq_marlin weight layout: repack QuantizedWeight to Marlin tiles and back.

Section names refer to docs/marlin.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from .packing import pack, unpack
from .qweight import QuantizedWeight, QuantLayoutError

TILE_K, TILE_N = 16, 64  # vLLM's marlin::tile_k_size / tile_n_size: one repack tile is 16 k x 64 n
MARLIN_BITS = (4, 8)
# AWQ stores logical column pf*c + j in slot AWQ_UNDO[bits][j] (vLLM awq_marlin_repack.cu `undo_pack`;
# docs/quantized-checkpoints.md, "AWQ GEMM layout").
AWQ_UNDO = {4: (0, 4, 1, 5, 2, 6, 3, 7), 8: (0, 2, 1, 3)}
# Column interleave the Marlin dequantizer expects inside every pf values (FasterTransformer's
# interleaved_numeric_conversion, used for weights and zero points alike).
INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


@dataclass(frozen=True)
class MarlinWeight:
    """vLLM gptq_marlin / awq_marlin layout of one linear ("vLLM gptq_marlin and awq_marlin").

    Attributes:
        qweight: int32 [K/16, N*bits/2], what vLLM's gptq_marlin_repack returns.
        scales: float [n_groups, N], marlin_permute_scales applied.
        zeros: int32 [n_groups, N*bits/32] in marlin_zero_points layout (uint4 with zero point), or None.
        g_idx: int32 [K], sort(g_idx) (act-order), or None.
        perm: int32 [K], argsort(g_idx): the kernel reads activation column perm[k] for packed row k; or None.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None
    bits: int
    group_size: int
    K: int  # noqa: N815 - GEMM letters
    N: int  # noqa: N815

    @property
    def act_order(self) -> bool:
        return self.perm is not None

    @property
    def has_zp(self) -> bool:
        return self.zeros is not None


def _check(size_k: int, size_n: int, bits: int, what: str) -> None:
    if bits not in MARLIN_BITS:
        raise QuantLayoutError(f"{what}: Marlin supports {MARLIN_BITS}-bit weights, not {bits}-bit")
    if size_k % TILE_K or size_n % TILE_N:
        raise QuantLayoutError(
            f"{what}: Marlin tiles are {TILE_K} x {TILE_N}, so K must be a multiple of {TILE_K} and N of "
            f"{TILE_N}; got K={size_k}, N={size_n}. Serve this layer with a non-Marlin kernel or pad it"
        )


@cache
def _tile_index(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather, inverse): flat tile position (16*64, row-major) of every packed value in output order.

    Output order is (word, slot) inside one tile's 1024/pf words. Mirrors gptq_marlin_repack.cu: thread `lane`
    of warp `w` reads rows 2(lane%4) + [0, 1, 8, 9] at columns 16w + lane//4 and +8 ("Closed form",
    "8-bit words").
    """
    lane = torch.arange(32).view(32, 1, 1)
    warp = torch.arange(4).view(1, 4, 1)
    col = 16 * warp + lane // 4  # [32, 4, 1]
    rows = 2 * (lane % 4) + torch.tensor([0, 1, 8, 9]).view(1, 1, 4)  # [32, 1, 4]
    v = torch.cat([rows * TILE_N + col, rows * TILE_N + col + 8], dim=-1)  # [32, 4, 8]: v[0..7] of the .cu
    # 4-bit: one word per (lane, warp) at lane*4 + warp, slot p holds v[INTERLEAVE[p]].
    # 8-bit: two words at lane*8 + warp*2 + {0, 1}: v[0..3] then v[4..7], each in slot order [0, 2, 1, 3].
    idx = v[..., list(INTERLEAVE[4])] if bits == 4 else v.view(32, 4, 2, 4)[..., list(INTERLEAVE[8])]
    idx = idx.reshape(-1).to(device)
    return idx, torch.argsort(idx)


@cache
def _scale_perms(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM get_scale_perms ("Scale permutations"): scale_perm[8a+b] = a+8b;
    scale_perm_single[8a+b] = 2a+off[b]."""
    t = torch.arange(64)
    scale_perm = t // 8 + 8 * (t % 8)
    t = torch.arange(32)
    scale_perm_single = 2 * (t // 8) + torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])[t % 8]
    return scale_perm.to(device), scale_perm_single.to(device)


def marlin_repack(q: torch.Tensor, bits: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Pack unsigned values into the Marlin tile layout.

    Args:
        q: uint8 [K, N] (GEMM orientation, natural row order).
        bits: 4 or 8.
        perm: optional int [K]; packed row k is q[perm[k]] (act-order, perm = argsort(g_idx)).
    Returns:
        int32 [K/16, N*bits/2], bit-identical to vLLM's gptq_marlin_repack.
    """
    if q.dim() != 2 or q.dtype != torch.uint8:
        raise QuantLayoutError(f"marlin_repack: q must be uint8 [K, N]; got {q.dtype} {tuple(q.shape)}")
    size_k, size_n = q.shape
    _check(size_k, size_n, bits, "marlin_repack")
    if perm is not None and perm.numel():
        if tuple(perm.shape) != (size_k,):
            raise QuantLayoutError(f"marlin_repack: perm must be [{size_k}]; got {list(perm.shape)}")
        q = q.index_select(0, perm.to(q.device, torch.long))
    idx, _ = _tile_index(bits, q.device)
    tiles = q.reshape(size_k // TILE_K, TILE_K, size_n // TILE_N, TILE_N).permute(0, 2, 1, 3)
    vals = tiles.reshape(size_k // TILE_K, size_n // TILE_N, TILE_K * TILE_N)[:, :, idx]
    return pack(vals.reshape(size_k // TILE_K, size_n * TILE_K), bits, dim=1)


def marlin_unpack(packed: torch.Tensor, K: int, N: int, bits: int) -> torch.Tensor:  # noqa: N803
    """Inverse of marlin_repack: int32 [K/16, N*bits/2] -> uint8 [K, N], rows in packed (perm) order."""
    _check(K, N, bits, "marlin_unpack")
    want = (K // TILE_K, N * bits // 2)
    if tuple(packed.shape) != want:
        raise QuantLayoutError(f"marlin_unpack: packed must be {list(want)}; got {list(packed.shape)}")
    _, inv = _tile_index(bits, packed.device)
    vals = unpack(packed, bits, dim=1).reshape(K // TILE_K, N // TILE_N, TILE_K * TILE_N)[:, :, inv]
    tiles = vals.reshape(K // TILE_K, N // TILE_N, TILE_K, TILE_N).permute(0, 2, 1, 3)
    return tiles.reshape(K, N).contiguous()


def gptq_marlin_repack(
    b_q_weight: torch.Tensor, perm: torch.Tensor | None, size_k: int, size_n: int, num_bits: int
) -> torch.Tensor:
    """vLLM's ops.gptq_marlin_repack: GPTQ qweight int32 [K/pf, N] (+ perm, empty or None) -> int32 Marlin."""
    _check(size_k, size_n, num_bits, "gptq_marlin_repack")
    want = (size_k * num_bits // 32, size_n)
    if tuple(b_q_weight.shape) != want:
        raise QuantLayoutError(
            f"gptq_marlin_repack: b_q_weight must be {list(want)}; got {list(b_q_weight.shape)}"
        )
    return marlin_repack(unpack(b_q_weight, num_bits, dim=0, count=size_k), num_bits, perm)


def awq_marlin_repack(b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """vLLM's ops.awq_marlin_repack: AWQ qweight int32 [K, N/pf] (AWQ interleave) -> int32 Marlin."""
    _check(size_k, size_n, num_bits, "awq_marlin_repack")
    pf = 32 // num_bits
    want = (size_k, size_n // pf)
    if tuple(b_q_weight.shape) != want:
        raise QuantLayoutError(
            f"awq_marlin_repack: b_q_weight must be {list(want)}; got {list(b_q_weight.shape)}"
        )
    slots = unpack(b_q_weight, num_bits, dim=1).reshape(size_k, size_n // pf, pf)
    q = slots[:, :, list(AWQ_UNDO[num_bits])].reshape(size_k, size_n)
    return marlin_repack(q, num_bits)


def _scale_perm_for(s: torch.Tensor, size_k: int, size_n: int, group_size: int, what: str) -> torch.Tensor:
    if s.dim() != 2 or s.shape[1] != size_n or size_n % TILE_N:
        raise QuantLayoutError(f"{what}: expected [n_groups, {size_n}] with N % 64 == 0; got {list(s.shape)}")
    scale_perm, scale_perm_single = _scale_perms(s.device)
    # Same test as vLLM's marlin_permute_scales: grouped only when a group is shorter than the full K.
    return scale_perm if group_size != -1 and group_size < size_k else scale_perm_single


def marlin_permute_scales(s: torch.Tensor, size_k: int, size_n: int, group_size: int) -> torch.Tensor:
    """[n_groups, N] -> same shape; 8x8 transpose per 64 (grouped) or scale_perm_single per 32 (channel-wise).

    With act-order pass the full input size as size_k, as vLLM does.
    """
    p = _scale_perm_for(s, size_k, size_n, group_size, "marlin_permute_scales")
    return s.reshape(-1, p.numel())[:, p].reshape(-1, size_n).contiguous()


def marlin_unpermute_scales(s: torch.Tensor, size_k: int, size_n: int, group_size: int) -> torch.Tensor:
    """Inverse of marlin_permute_scales."""
    p = _scale_perm_for(s, size_k, size_n, group_size, "marlin_unpermute_scales")
    return s.reshape(-1, p.numel())[:, torch.argsort(p)].reshape(-1, size_n).contiguous()


def marlin_zero_points(zp: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """uint8 zero points [n_groups, N] -> int32 [n_groups, N*bits/32] (vLLM marlin_zero_points, "Zero
    points").

    scale_perm on chunks of 64 (never the single variant: zero points apply on every MMA), then the
    dequantizer interleave inside every 32/bits values, then LSB-first packing along N. size_k is unused and
    kept for vLLM's signature.
    """
    if num_bits not in MARLIN_BITS:
        raise QuantLayoutError(f"marlin_zero_points: Marlin supports {MARLIN_BITS}-bit, not {num_bits}-bit")
    if zp.dim() != 2 or zp.shape[1] != size_n or size_n % TILE_N:
        raise QuantLayoutError(
            f"marlin_zero_points: expected [n_groups, {size_n}], N % 64 == 0; got {list(zp.shape)}"
        )
    scale_perm, _ = _scale_perms(zp.device)
    inter = torch.tensor(INTERLEAVE[num_bits], device=zp.device)
    z = zp.reshape(-1, 64)[:, scale_perm].reshape(-1, inter.numel())[:, inter]
    return pack(z.reshape(-1, size_n).to(torch.uint8), num_bits, dim=1)


def marlin_unpack_zero_points(packed: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """Inverse of marlin_zero_points: int32 [n_groups, N*bits/32] -> uint8 [n_groups, N]."""
    if num_bits not in MARLIN_BITS:
        raise QuantLayoutError(
            f"marlin_unpack_zero_points: Marlin supports {MARLIN_BITS}-bit, not {num_bits}-bit"
        )
    if packed.dim() != 2 or packed.shape[1] * 32 != size_n * num_bits or size_n % TILE_N:
        raise QuantLayoutError(
            f"marlin_unpack_zero_points: expected [n_groups, {size_n * num_bits // 32}]; got {list(packed.shape)}"
        )
    scale_perm, _ = _scale_perms(packed.device)
    inter = torch.tensor(INTERLEAVE[num_bits], device=packed.device)
    z = unpack(packed, num_bits, dim=1).reshape(-1, inter.numel())[:, torch.argsort(inter)]
    return z.reshape(-1, 64)[:, torch.argsort(scale_perm)].reshape(-1, size_n).contiguous()


def marlin_permute_bias(bias: torch.Tensor) -> torch.Tensor:
    """vLLM marlin_permute_bias: scale_perm_single on chunks of 32 (N must be a multiple of 32)."""
    if bias.numel() % 32:
        raise QuantLayoutError(f"marlin_permute_bias: bias size {bias.numel()} is not a multiple of 32")
    _, single = _scale_perms(bias.device)
    return bias.reshape(-1, 32)[:, single].reshape(bias.shape).contiguous()


def to_marlin(w: QuantizedWeight, name: str = "weight") -> MarlinWeight:
    """Repack a canonical QuantizedWeight the way vLLM's MarlinLinearKernel does after loading.

    Symmetric weights become uint4b8 / uint8b128 (no zeros); asymmetric 4-bit becomes uint4 with Marlin zero
    points. With act-order, perm = argsort(g_idx) (stable), g_idx is sorted and rows are gathered by perm.
    A g_idx equal to the trivial i // G is kept as act-order; call w.with_trivial_g_idx_dropped() first to avoid it.

    Raises:
        QuantLayoutError: bits not 4 or 8, K % 16, N % 64, asymmetric 8-bit, or an invalid QuantizedWeight.
    """
    _check(w.K, w.N, w.bits, name)
    if w.bits == 8 and w.zeros is not None:
        raise QuantLayoutError(
            f"{name}: asymmetric 8-bit is not a Marlin type (vLLM has uint8b128 without zero points only); "
            "requantize symmetrically or use 4-bit"
        )
    w.validate(name)
    perm = g_sorted = None
    if w.g_idx is not None:
        perm = torch.argsort(w.g_idx, stable=True).to(torch.int32)
        g_sorted = w.g_idx[perm.long()].to(torch.int32)
    return MarlinWeight(
        qweight=marlin_repack(w.qweight, w.bits, perm),
        scales=marlin_permute_scales(w.scales, w.K, w.N, w.group_size),
        zeros=None if w.zeros is None else marlin_zero_points(w.zeros, w.K, w.N, w.bits),
        g_idx=g_sorted,
        perm=perm,
        bits=w.bits,
        group_size=w.group_size,
        K=w.K,
        N=w.N,
    )


def concat_n(parts: list[MarlinWeight], name: str = "weight") -> MarlinWeight:
    """The Marlin weight of the linears in `parts` side by side (their outputs concatenated: fused QKV, gate/up).

    Every Marlin structure permutes within a 64-column tile and lays the tiles out along N in order (the
    qweight's words, the scale permutation, the zero points' 64-chunk transpose), so with every N a multiple of
    64 concatenating along N commutes with the repack: concat_n(to_marlin(a), to_marlin(b)) equals
    to_marlin(a | b) bit for bit (tests/kernels/test_marlin_layout.py). Act-order rows must be permuted alike.

    Raises:
        QuantLayoutError: the parts differ in K, bits, group size, zero points or act-order permutation.
    """
    first = parts[0]
    for p in parts[1:]:
        same = (p.K, p.bits, p.group_size, p.zeros is None, p.perm is None) == (
            first.K, first.bits, first.group_size, first.zeros is None, first.perm is None
        )  # fmt: skip
        if not same or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise QuantLayoutError(
                f"{name}: cannot fuse linears that differ in K, bits, group size, zero points or act-order"
            )
    return MarlinWeight(
        qweight=torch.cat([p.qweight for p in parts], dim=1),
        scales=torch.cat([p.scales for p in parts], dim=1),
        zeros=None if first.zeros is None else torch.cat([p.zeros for p in parts], dim=1),
        g_idx=first.g_idx,
        perm=first.perm,
        bits=first.bits,
        group_size=first.group_size,
        K=first.K,
        N=sum(p.N for p in parts),
    )


def from_marlin(m: MarlinWeight) -> QuantizedWeight:
    """Exact inverse of to_marlin: the canonical QuantizedWeight, rows and g_idx back in natural order."""
    q = marlin_unpack(m.qweight, m.K, m.N, m.bits)
    g_idx = None
    if m.perm is not None:
        perm = m.perm.to(q.device, torch.long)
        natural = torch.empty_like(q)
        natural[perm] = q
        q = natural
        if m.g_idx is not None:
            g_idx = torch.empty_like(m.g_idx)
            g_idx[perm.to(m.g_idx.device)] = m.g_idx
    zeros = None if m.zeros is None else marlin_unpack_zero_points(m.zeros, m.K, m.N, m.bits)
    return QuantizedWeight(
        qweight=q,
        scales=marlin_unpermute_scales(m.scales, m.K, m.N, m.group_size),
        zeros=zeros,
        bits=m.bits,
        group_size=m.group_size,
        g_idx=g_idx,
    )
