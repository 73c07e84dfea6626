"""QuantizedWeight: the one in-memory form of group-quantized weights that every reader, writer and kernel shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .grouping import SUPPORTED_BITS, n_groups

__all__ = ["SUPPORTED_BITS", "QuantLayoutError", "QuantizedWeight", "n_groups"]


class QuantLayoutError(ValueError):
    """A quantized tensor has the wrong shape, dtype, bit width or group size; the message names it."""


@dataclass(frozen=True)
class QuantizedWeight:
    """Group-quantized weight of one linear layer, in GEMM orientation (K = in_features, N = out_features).

    `W[i, o] = scales[g(i), o] * (qweight[i, o] - zero(g(i), o))` with `g(i) = g_idx[i]`, or `i // group_size`
    when `g_idx` is None. `zeros` None means symmetric, zero = 2^(bits-1) (GPTQ's uint4b8 / uint8b128).

    Attributes:
        qweight: uint8 [K, N], unsigned values in [0, 2^bits - 1].
        scales: float16, bfloat16 or float32 [n_groups, N].
        zeros: uint8 [n_groups, N] unsigned zero points (GPTQ v2 semantics), or None (symmetric).
        bits: 2, 3, 4 or 8.
        group_size: positive, or -1 for one group spanning K.
        g_idx: int32 [K], the group of each input row (act-order); None for the trivial i // group_size.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def K(self) -> int:  # noqa: N802 - GEMM letters
        return self.qweight.shape[0]

    @property
    def N(self) -> int:  # noqa: N802
        return self.qweight.shape[1]

    @property
    def group(self) -> int:
        """The group size as a count of rows (K when group_size is -1)."""
        return self.K if self.group_size == -1 else self.group_size

    @property
    def n_groups(self) -> int:
        return n_groups(self.K, self.group_size)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def act_order(self) -> bool:
        return self.g_idx is not None

    def groups(self) -> torch.Tensor:
        """int64 [K]: the group of each input row."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.K, device=self.qweight.device) // self.group

    def zero_points(self) -> torch.Tensor:
        """uint8 [n_groups, N]: the zero points, materialised for symmetric weights too."""
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, 1 << (self.bits - 1), dtype=torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[K, N] in `dtype`; transpose for nn.Linear's [N, K]. Computed in fp32, the reference for every kernel."""
        g = self.groups()
        s = self.scales.float()[g]
        z = self.zero_points().float()[g]
        return (s * (self.qweight.float() - z)).to(dtype)

    def validate(self, name: str = "weight") -> QuantizedWeight:
        """Check shapes, dtypes and ranges; returns self. Raises QuantLayoutError naming `name` and the numbers."""
        k, n = self.qweight.shape if self.qweight.dim() == 2 else (-1, -1)
        if self.qweight.dim() != 2 or self.qweight.dtype != torch.uint8:
            raise QuantLayoutError(
                f"{name}: qweight must be uint8 [K, N]; got {self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        if self.bits not in SUPPORTED_BITS:
            raise QuantLayoutError(f"{name}: {self.bits}-bit is not supported (supported: {SUPPORTED_BITS})")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantLayoutError(f"{name}: group_size must be positive or -1; got {self.group_size}")
        if self.g_idx is None and self.group_size != -1 and k % self.group_size:
            raise QuantLayoutError(
                f"{name}: K={k} is not a multiple of group_size {self.group_size}; use a group size that divides "
                f"K (e.g. {_divisor_hint(k)}) or -1"
            )
        want = (self.n_groups, n)
        if tuple(self.scales.shape) != want or not self.scales.is_floating_point():
            raise QuantLayoutError(
                f"{name}: scales must be float {list(want)}; got {self.scales.dtype} {list(self.scales.shape)}"
            )
        if self.zeros is not None and (tuple(self.zeros.shape) != want or self.zeros.dtype != torch.uint8):
            raise QuantLayoutError(
                f"{name}: zeros must be uint8 {list(want)}; got {self.zeros.dtype} {list(self.zeros.shape)}"
            )
        maxq = (1 << self.bits) - 1
        if int(self.qweight.max()) > maxq or (self.zeros is not None and int(self.zeros.max()) > maxq):
            raise QuantLayoutError(f"{name}: values exceed {maxq}, the largest {self.bits}-bit value")
        if self.g_idx is not None:
            if tuple(self.g_idx.shape) != (k,):
                raise QuantLayoutError(f"{name}: g_idx must be [{k}]; got {list(self.g_idx.shape)}")
            if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= self.n_groups):
                raise QuantLayoutError(
                    f"{name}: g_idx values must lie in [0, {self.n_groups}); got "
                    f"[{int(self.g_idx.min())}, {int(self.g_idx.max())}]"
                )
        return self

    def with_trivial_g_idx_dropped(self) -> QuantizedWeight:
        """g_idx equal to arange(K) // group carries no act-order (static groups); drop it so fast paths apply."""
        if self.g_idx is None or self.group_size == -1 and bool((self.g_idx == 0).all()):
            return self if self.g_idx is None else _replace(self, g_idx=None)
        trivial = torch.arange(self.K, device=self.g_idx.device) // self.group
        return _replace(self, g_idx=None) if torch.equal(self.g_idx.long(), trivial) else self


def _replace(w: QuantizedWeight, **changes) -> QuantizedWeight:
    from dataclasses import replace

    return replace(w, **changes)


def _divisor_hint(k: int) -> str:
    return ", ".join(str(g) for g in (128, 64, 32) if k % g == 0) or "-1"
