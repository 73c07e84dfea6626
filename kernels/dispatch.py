"""Choose a W4A16 kernel for a Marlin weight: a registry in priority order, each kernel saying why it can't.

Follows vLLM's mixed-precision kernel selection (`choose_mp_linear_kernel`): every kernel class answers
`can_implement(...) -> (ok, reason)`, the first that can is used, and when none can the error lists all reasons.
A kernel has a per-layer `prepare(mw) -> state` (run once after loading: repack, unpack, caches) and an
`apply(state, x, bias) -> out` (x [..., K] -> [..., N] in x.dtype). GEMM letters: K = in, N = out features.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch

from .marlin import MarlinWeight
from .w4a16_cpu import CpuDenseKernel, CpuDequantKernel
from .w4a16_triton import TritonW4A16Kernel


class Kernel(Protocol):
    name: str

    @classmethod
    def can_implement(
        cls, mw: MarlinWeight, x_dtype: torch.dtype, device: torch.device | str
    ) -> tuple[bool, str]: ...

    def prepare(self, mw: MarlinWeight) -> Any: ...

    def apply(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


class KernelUnavailableError(ValueError):
    """No registered kernel can run this weight / dtype / device; the message lists every kernel's reason."""


# Register a kernel by adding its class here. Order is the default priority.
KERNELS: tuple[type[Kernel], ...] = (TritonW4A16Kernel, CpuDequantKernel, CpuDenseKernel)
# Per-device priority (vLLM keeps one list per platform). On CPU the torch paths come first: Triton runs CPU
# tensors only through its interpreter, which is a test tool (ask for it by name). cpu_dequant before
# cpu_dense keeps the 4-bit model's memory small; pick cpu_dense by name when speed matters more.
PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("triton_w4a16",),
    "cpu": ("cpu_dequant", "cpu_dense", "triton_w4a16"),
}


def kernel_names() -> list[str]:
    return [k.name for k in KERNELS]


def _candidates(device: torch.device) -> list[type[Kernel]]:
    first = PRIORITY.get(device.type, ())
    return sorted(KERNELS, key=lambda k: first.index(k.name) if k.name in first else len(first))


def select_kernel(
    mw: MarlinWeight, x_dtype: torch.dtype, device: torch.device | str, name: str | None = None
) -> Kernel:
    """The first kernel (or the one named) that can run `mw` with activations of `x_dtype` on `device`.

    Raises:
        KernelUnavailableError: none can (or `name` can't / is unknown); the message gives every reason.
    """
    device = torch.device(device)
    if name is not None and name not in kernel_names():
        raise KernelUnavailableError(f"unknown W4A16 kernel {name!r}; known: {', '.join(kernel_names())}")
    reasons = []
    for cls in _candidates(device):
        if name is not None and cls.name != name:
            continue
        ok, why = cls.can_implement(mw, x_dtype, device)
        if ok:
            return cls()
        reasons.append(f"{cls.name}: {why}")
    what = (
        f"{mw.bits}-bit K={mw.K} N={mw.N} group_size={mw.group_size} with {x_dtype} activations on {device}"
    )
    raise KernelUnavailableError(
        f"no W4A16 kernel can run {what}:\n  "
        + "\n  ".join(reasons)
        + "\nUse a CUDA GPU (sm80+) with triton installed, or CPU tensors; or serve this model with "
        "--backend llamacpp."
    )


@dataclass(frozen=True)
class W4A16Linear:
    """A prepared layer: `layer(x, bias)` runs the chosen kernel on x [..., K] and returns [..., N]."""

    kernel: Kernel
    state: Any
    K: int  # noqa: N815 - GEMM letters
    N: int  # noqa: N815

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.apply(self.state, x, bias)


def prepare_w4a16(
    mw: MarlinWeight,
    x_dtype: torch.dtype,
    device: torch.device | str | None = None,
    name: str | None = None,
) -> W4A16Linear:
    """Select a kernel for activations of `x_dtype` on `device` (default: where mw.qweight lives), move the
    weight there and run the kernel's per-layer prepare once. Call this after loading; keep the result."""
    device = mw.qweight.device if device is None else torch.device(device)
    kernel = select_kernel(mw, x_dtype, device, name)
    if mw.qweight.device != device:
        moved = {f.name: getattr(mw, f.name) for f in fields(mw)}
        mw = replace(mw, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})
    return W4A16Linear(kernel, kernel.prepare(mw), mw.K, mw.N)


def w4a16_linear(
    x: torch.Tensor, mw: MarlinWeight, kernel: Kernel | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """One-shot `x @ W (+ bias)`: x [..., K] -> [..., N] in x.dtype. Selects (unless `kernel` is given) and
    prepares on every call, which the CPU kernels pay dearly for; models should use prepare_w4a16 once."""
    kernel = kernel or select_kernel(mw, x.dtype, x.device)
    return kernel.apply(kernel.prepare(mw), x, bias)
