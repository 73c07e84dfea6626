"""Host side of the Triton W4A16 path: per-layer state, launch configs, the GEMM / dequantize wrappers and the
`TritonW4A16Kernel` that kernels/dispatch.py registers. The kernel bodies, and how they read the Marlin layout,
are in w4a16_jit.py.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .marlin import MarlinWeight
from .w4a16_jit import _jit_kernels, sum_splits
from .w4a16_plain import PlainState, plain_dequantize, plain_gemm, prepare_plain


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (TRITON_INTERPRET, read at call time as triton does)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class TritonW4A16State:
    """A MarlinWeight checked once for the kernels; `g_idx` is dropped when the sorted g_idx is the trivial
    k // group (always the case for GPTQ act-order, whose groups are formed in permuted order), so that only the
    activation perm remains and the fast group modes apply."""

    qweight: torch.Tensor  # int32 [K/16, N*bits/2]
    scales: torch.Tensor  # [n_groups, N], Marlin-permuted, any float dtype
    zeros: torch.Tensor | None  # int32 [n_groups, N*bits/32] marlin_zero_points layout
    g_idx: torch.Tensor | None  # int32 [K] sorted, only when not trivial
    perm: torch.Tensor | None  # int32 [K]
    bits: int
    group: int  # rows per group; K for per-channel
    scale_single: bool  # channel-wise scale permutation (vLLM: group_size == -1 or >= K)
    K: int  # noqa: N815 - GEMM letters
    N: int  # noqa: N815


def prepare_marlin(mw: MarlinWeight) -> TritonW4A16State:
    """Check shapes and dtypes of a MarlinWeight and make its tensors contiguous. Raises QuantLayoutError."""
    from .qweight import QuantLayoutError

    k, n, bits = mw.K, mw.N, mw.bits
    want = (k // 16, n * bits // 2)
    if bits not in (4, 8) or k % 16 or n % 64:
        raise QuantLayoutError(
            f"Marlin weight K={k}, N={n}, {bits}-bit: needs 4/8-bit, K % 16 == 0, N % 64 == 0"
        )
    if mw.qweight.dtype != torch.int32 or tuple(mw.qweight.shape) != want:
        raise QuantLayoutError(
            f"qweight must be int32 {list(want)}; got {mw.qweight.dtype} {list(mw.qweight.shape)}"
        )
    group = k if mw.group_size == -1 else mw.group_size
    n_groups = -(-k // group)
    if tuple(mw.scales.shape) != (n_groups, n) or not mw.scales.is_floating_point():
        raise QuantLayoutError(
            f"scales must be float [{n_groups}, {n}]; got {mw.scales.dtype} {list(mw.scales.shape)}"
        )
    if mw.zeros is not None and tuple(mw.zeros.shape) != (n_groups, n * bits // 32):
        raise QuantLayoutError(
            f"zeros must be int32 [{n_groups}, {n * bits // 32}]; got {list(mw.zeros.shape)}"
        )
    g_idx = mw.g_idx
    if g_idx is not None:
        trivial = torch.arange(k, device=g_idx.device) // group
        g_idx = None if torch.equal(g_idx.long(), trivial) else g_idx.to(torch.int32).contiguous()
    return TritonW4A16State(
        qweight=mw.qweight.contiguous(),
        scales=mw.scales.contiguous(),
        zeros=None if mw.zeros is None else mw.zeros.to(torch.int32).contiguous(),
        g_idx=g_idx,
        perm=None if mw.perm is None else mw.perm.to(torch.int32).contiguous(),
        bits=bits,
        group=group,
        scale_single=mw.group_size == -1 or mw.group_size >= k,
        K=k,
        N=n,
    )


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of the fused kernel. block_n is a multiple of 64 (a Marlin tile), block_k of 64."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # > 1: programs split K, store fp32 partials, a second small launch sums them
    use_dot: bool = True  # False: CUDA-core FMAs (tiny M), no tensor-core operand layout conversion
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _device_info(index: int) -> tuple[int, int]:
    """(SM count, compute capability major) of a CUDA device, queried on first use, never at import."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major


def default_config(
    m: int, k: int, n: int, group: int, sm_count: int = 0, gathered: bool = False, major: int = 9
) -> GemmConfig:
    """Heuristic launch config: untuned on hardware; run bench/w4a16_gemm.py --sweep on the target GPU.

    Chosen so that nothing spills registers on sm80/sm90 (checked with ptxas through triton.compile for
    GPUTarget cuda 80/90). Small M streams the packed weight once with split-K so that ~4 programs per SM keep
    loads in flight, capped so that the fp32 partials (split * M * N * 4 bytes) stay below the weight bytes.
    block_k divides the group when it can, so scales apply once per K block; `gathered` (per-(k, n) scales)
    needs the smaller block_k to stay in registers. `major` is the compute capability's major version.
    """
    block_k = 128 if not gathered and m <= 16 and k % 128 == 0 and (group >= k or group % 128 == 0) else 64
    block_n = 128 if n % 128 == 0 else 64
    if m <= 2:
        block_m, use_dot, warps = m, False, 8
    elif m <= 16:
        block_m, use_dot, warps = 16, True, 8 if gathered else 4
    elif m <= 32:
        block_m, use_dot, warps = 32, True, 4
    else:
        block_m, use_dot, warps = 128 if m > 64 and major >= 9 else 64, True, 8
    tiles = -(-m // block_m) * -(-n // block_n)
    k_blocks = -(-k // block_k)
    split = 1
    if sm_count and tiles < 2 * sm_count:
        split = max(1, min(k_blocks, (4 * sm_count) // tiles, k // (16 * m)))
        split = -(-k_blocks // -(-k_blocks // split))  # no empty splits
    return GemmConfig(block_m, block_n, block_k, split, use_dot, warps, 4 if m <= 16 else 3)


def w4a16_gemm(
    x: torch.Tensor,
    state: TritonW4A16State,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Fused W4A16 (and W8A16) GEMM: x [..., K] fp16/bf16/fp32 -> [..., N] in x.dtype, fp32 accumulation.

    Act-order is applied by gathering x columns through `perm` inside the kernel; `bias` is natural-order [N].
    """
    k, n = state.K, state.N
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    dev = x2.device
    if config is None:
        gathered = state.g_idx is not None or (state.group < k and state.group % 64 != 0)
        sms, major = _device_info(dev.index or 0) if dev.type == "cuda" else (0, 9)
        config = default_config(m, k, n, state.group, sms, gathered, major)
    cfg = config
    if state.g_idx is not None:
        group_mode = 2
    elif state.group >= k:
        group_mode = 0
    else:
        group_mode = 1 if state.group % cfg.block_k == 0 else 2
    k_blocks = -(-k // cfg.block_k)
    per_split = -(-k_blocks // cfg.split_k)
    split = -(-k_blocks // per_split)
    partial = split > 1
    interp = interpreting()
    # Triton 3.9's interpreter mishandles bf16: tl.dot on bf16 operands returns garbage and fp32 -> bf16 casts
    # truncate (GPUs round to nearest). Interpreted bf16 therefore dots in fp32 (exact: bf16 x and the small
    # integers q - zero are fp32 values) and stores fp32, rounded by torch below, as the GPU would.
    bf16_fix = interp and x.dtype == torch.bfloat16
    out = torch.empty(m, n, device=dev, dtype=torch.float32 if bf16_fix else x.dtype)
    ws = torch.empty(split, m, n, device=dev, dtype=torch.float32) if partial else out
    gemm, _, _ = _jit_kernels(interp)
    dummy = state.qweight
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n), split)
    gemm[grid](
        x2, state.qweight, state.scales,
        dummy if state.zeros is None else state.zeros,
        dummy if state.g_idx is None else state.g_idx,
        dummy if state.perm is None else state.perm,
        dummy if bias is None else bias,
        ws, m, n, k, x2.stride(0), n, state.qweight.stride(0), state.group, per_split,
        BITS=state.bits, HAS_ZP=state.zeros is not None, HAS_PERM=state.perm is not None,
        HAS_GIDX=state.g_idx is not None, HAS_BIAS=bias is not None and not partial, GROUP_MODE=group_mode,
        SCALE_SINGLE=state.scale_single, USE_DOT=cfg.use_dot,
        W_FP32=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and (group_mode == 2 or interp)),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PARTIAL=partial,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True,
    )  # fmt: skip
    if partial:
        sum_splits(ws, bias, out, interp)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def marlin_dequantize(
    state: TritonW4A16State, dtype: torch.dtype = torch.float16, block_k: int = 64, block_n: int = 128
) -> torch.Tensor:
    """Dense [K, N] weight in `dtype`, natural row order (act-order rows scattered back through perm), so the
    prefill path is just `x @ W`. Reads K*N*bits/8 bytes and writes K*N*2: worth it only when the matmul that
    follows is compute-bound (large M)."""
    k, n = state.K, state.N
    block_n = block_n if n % block_n == 0 else 64
    interp = interpreting()
    bf16_fix = interp and dtype == torch.bfloat16  # the interpreter truncates fp32 -> bf16; see w4a16_gemm
    w = torch.empty(k, n, device=state.qweight.device, dtype=torch.float32 if bf16_fix else dtype)
    _, dequant, _ = _jit_kernels(interp)
    dummy = state.qweight
    dequant[(-(-k // block_k), n // block_n)](
        state.qweight, state.scales,
        dummy if state.zeros is None else state.zeros,
        dummy if state.g_idx is None else state.g_idx,
        dummy if state.perm is None else state.perm,
        w, n, k, state.qweight.stride(0), state.group,
        BITS=state.bits, HAS_ZP=state.zeros is not None, HAS_PERM=state.perm is not None,
        HAS_GIDX=state.g_idx is not None, SCALE_SINGLE=state.scale_single, BLOCK_N=block_n, BLOCK_K=block_k,
        enable_fp_fusion=True,  # explicit: Triton 3.10 flips the default
    )  # fmt: skip
    return w.to(dtype)


class TritonW4A16Kernel:
    """Marlin weights, W4A16/W8A16 through Triton on CUDA (sm80+); on CPU only under TRITON_INTERPRET=1 (tests).

    prepare() makes the K-packed copy of w4a16_plain.py where the weight's groups allow (all but act-order with
    uneven groups and groups under 32 rows), else keeps the Marlin layout for the kernels of w4a16_jit.py.
    M < dequant_min_m: the fused kernel (split-K GEMV for small M, tensor-core tiles above). M >= dequant_min_m:
    dequantize to a dense [K, N] temporary (K*N*2 bytes, freed after the call) and use cuBLAS. Measured on an
    H100 (bench/results/gpu-2026-11-26.md), the K-packed kernel wins up to M = 64 and the two are level at 128
    (a Llama-3-8B layer: 407 us fused, 384 us dequantized), where the fused kernel's tensor-core tiles stall on
    unpacking; at 512 dequantizing takes half the time. Hence 128.
    """

    name = "triton_w4a16"

    def __init__(self, dequant_min_m: int = 128, plain: bool = True) -> None:
        self.dequant_min_m = dequant_min_m
        self.plain = plain  # False: the Marlin-layout kernels only (benchmarks compare the two)

    @classmethod
    def can_implement(
        cls, mw: MarlinWeight, x_dtype: torch.dtype, device: torch.device | str
    ) -> tuple[bool, str]:
        device = torch.device(device)
        if mw.bits not in (4, 8):
            return False, f"{mw.bits}-bit weights (the Marlin layout holds 4- or 8-bit)"
        if mw.K % 16 or mw.N % 64:
            return False, f"K={mw.K}, N={mw.N}: Marlin tiles need K % 16 == 0 and N % 64 == 0"
        if x_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"activations {x_dtype} (needs float16, bfloat16 or float32)"
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install triton)"
        if device.type == "cpu":
            if not interpreting():
                return False, "CPU tensors run Triton only in its interpreter (TRITON_INTERPRET=1, for tests)"
            return True, ""
        if device.type != "cuda":
            return False, f"device {device} (needs cuda)"
        if not torch.cuda.is_available():
            return False, "CUDA is not available in this torch build or machine"
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            return (
                False,
                f"compute capability {cap[0]}.{cap[1]} < 8.0 (bf16 tensor cores, as Marlin requires)",
            )
        return True, ""

    def prepare(self, mw: MarlinWeight) -> PlainState | TritonW4A16State:
        """The K-packed copy (w4a16_plain.py) when the weight's groups suit it, else the Marlin-layout state."""
        if self.plain:
            plain = prepare_plain(mw)
            if plain is not None:
                return plain
        return prepare_marlin(mw)

    def path(self, m: int, state: PlainState | TritonW4A16State | None = None) -> str:
        """Which path apply() takes for M rows (printed by the benchmark)."""
        if m >= self.dequant_min_m:
            return "dequant+matmul"
        if isinstance(state, PlainState) or (state is None and self.plain):
            return "plain-fma" if m == 1 else "plain-dot"
        return "fused-fma" if m <= 2 else "fused-dot"

    def apply(
        self, state: PlainState | TritonW4A16State, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype. Raises ValueError on a K or device mismatch."""
        if x.shape[-1] != state.K:
            raise ValueError(f"W4A16 linear: x has {x.shape[-1]} input features, the weight has K={state.K}")
        if x.device != state.qweight.device:
            raise ValueError(f"W4A16 linear: x is on {x.device}, the weight on {state.qweight.device}")
        m = x.numel() // state.K
        plain = isinstance(state, PlainState)
        if m < self.dequant_min_m:
            if plain:
                sms = _device_info(x.device.index or 0)[0] if x.device.type == "cuda" else 0
                return plain_gemm(x, state, bias, sm_count=sms, interpret=interpreting())
            return w4a16_gemm(x, state, bias)
        x2 = x.reshape(-1, state.K)
        if plain:
            w = plain_dequantize(state, x.dtype, interpret=interpreting())  # rows in packed order
            if state.perm is not None:
                x2 = x2.index_select(1, state.perm)
        else:
            w = marlin_dequantize(state, x.dtype)
        out = x2 @ w if bias is None else torch.addmm(bias.to(x.dtype), x2, w)
        return out.reshape(*x.shape[:-1], state.N)
