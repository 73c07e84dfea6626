"""W4A16 kernels (Triton under its CPU interpreter, the torch CPU paths) against the fp32 dequantize-then-matmul
reference, kernel selection through can_implement, and the Triton kernels compiled for sm80/sm90 cubins.

TRITON_INTERPRET is set per test by a fixture, deliberately not at import time before triton: triton wraps its
own library (tl.sum, tl.zeros, ...) with @jit when it is imported, so importing it with TRITON_INTERPRET=1 makes
those interpreted for the whole process, which breaks every later GPU compile (ours below, inductor's) and would
leak into every other test module of the session. Our kernels use only Triton builtins and are wrapped at first
call keyed by the flag, so they run interpreted whichever came first (both orders are checked in subprocesses).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import random
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton  # before any test sets TRITON_INTERPRET: see the module docstring

from quantserve.kernels.dispatch import (
    KernelUnavailableError,
    W4A16Linear,
    prepare_w4a16,
    select_kernel,
    w4a16_linear,
)
from quantserve.kernels.marlin import MarlinWeight, marlin_zero_points, to_marlin
from quantserve.kernels.qweight import QuantizedWeight
from quantserve.kernels.reference import dequantize_marlin, relative_error, w4a16_reference
from quantserve.kernels.w4a16_cpu import CpuDenseKernel, CpuDequantKernel
from quantserve.kernels.w4a16_plain import (
    PlainConfig,
    PlainState,
    plain_dequantize,
    plain_gemm,
    prepare_plain,
)
from quantserve.kernels.w4a16_triton import (
    GemmConfig,
    TritonW4A16Kernel,
    _jit_kernels,
    default_config,
    marlin_dequantize,
    prepare_marlin,
    w4a16_gemm,
)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.node.get_closest_marker("cuda") else "1")


def make_weight(k, n, group=128, bits=4, zp=False, act=None, scale_dtype=F16, seed=0) -> MarlinWeight:
    """Random canonical weight repacked to Marlin. act: None, "gptq" (groups formed in a permuted order, so the
    sorted g_idx is trivial) or "random" (uneven groups, the general case)."""
    gen = torch.Generator().manual_seed(seed)
    rows = k if group == -1 else group
    n_groups = -(-k // rows)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n_groups, n, generator=gen) * 0.02 + 0.002).to(scale_dtype)
    zeros = torch.randint(0, 1 << bits, (n_groups, n), generator=gen, dtype=torch.uint8) if zp else None
    g_idx = None
    if act == "gptq":
        g_idx = (torch.arange(k) // rows)[torch.randperm(k, generator=gen)].to(torch.int32)
    elif act == "random":
        g_idx = torch.randint(0, n_groups, (k,), generator=gen, dtype=torch.int32)
    return to_marlin(QuantizedWeight(q, scales, zeros, bits, group, g_idx))


def activations(m, k, dtype, seed=1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check(out: torch.Tensor, x: torch.Tensor, mw: MarlinWeight, bias=None, tol=1e-3) -> None:
    """Reference from the same (already rounded) x; rounded to the output dtype, since bf16 output rounding
    alone is ~1.3e-3 relative and would swamp the kernel's own error."""
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], mw.N)
    ref = w4a16_reference(x, mw, bias).to(x.dtype)
    err = relative_error(out, ref)
    assert err < tol, f"relative error {err:.2e}"


# (M, K, N, group, x dtype, zero points, act-order, bits): every value of every axis appears several times;
# the comments name the code path each row is there for.
CASES = [
    (1, 128, 64, 128, F16, False, None, 4),  # group == K: channel-wise scale perm, FMA path
    (3, 576, 192, 64, BF16, True, None, 4),  # SmolLM2 K, scale per K block, partial N tile
    (16, 256, 64, -1, F32, True, "gptq", 4),  # per-channel with zero points, act-order perm
    (33, 256, 192, 128, F16, False, "gptq", 4),  # act-order with trivial sorted groups: perm only
    (1, 256, 192, 64, F32, False, "random", 4),  # uneven groups: per-(k, n) scale gather
    (16, 576, 64, -1, BF16, False, None, 4),
    (33, 128, 64, 64, BF16, True, "random", 4),  # bf16 with gathered scales: fp32 (tf32) dot
    (3, 256, 64, 128, F16, True, None, 4),
    (1, 576, 192, 64, F16, False, "gptq", 4),
    (33, 576, 192, -1, F32, False, None, 4),
    (16, 128, 192, -1, F16, False, None, 8),
    (3, 256, 64, 64, BF16, False, "gptq", 8),
    (33, 576, 64, 64, F32, False, None, 8),
    (1, 128, 192, 128, BF16, False, "random", 8),
]


def _sweep() -> list[tuple]:
    """Every (M, K, N) of the grid once, with the other axes drawn from a fixed seed; groups that do not divide
    K get act-order (a short last group, as GPTQ makes for such K)."""
    rng = random.Random(0)
    cases = []
    for m, k, n in itertools.product((1, 3, 16, 33), (128, 576, 256), (64, 192)):
        group, dtype = rng.choice((-1, 64, 128)), rng.choice((F16, BF16, F32))
        bits = rng.choice((4, 4, 4, 8))
        zp, act = bits == 4 and rng.random() < 0.5, rng.choice((None, "gptq", "random"))
        if group != -1 and k % group and act is None:
            act = "gptq"
        cases.append((m, k, n, group, dtype, zp, act, bits))
    return cases


@pytest.mark.parametrize("m,k,n,group,dtype,zp,act,bits", CASES + _sweep())
def test_triton_gemm_matches_reference(m, k, n, group, dtype, zp, act, bits):
    mw = make_weight(k, n, group, bits, zp, act, scale_dtype=F16 if dtype == F32 else dtype)
    x = activations(m, k, dtype)
    check(w4a16_gemm(x, prepare_marlin(mw)), x, mw)


@pytest.mark.parametrize("m,k,n,group,dtype,zp,act,bits", CASES + _sweep())
def test_plain_gemm_matches_reference(m, k, n, group, dtype, zp, act, bits):
    """The K-packed kernel on every case whose groups it takes (the others keep the Marlin kernel), with a bias,
    through the default config and two explicit ones (split-K with a K tail; FMAs)."""
    mw = make_weight(k, n, group, bits, zp, act, scale_dtype=F16 if dtype == F32 else dtype)
    state = prepare_plain(mw)
    rows = k if group == -1 else group
    if state is None:
        assert act == "random" or rows % 32
        return
    x = activations(m, k, dtype)
    bias = torch.randn(n).to(dtype)
    check(plain_gemm(x, state, bias, interpret=True), x, mw, bias)
    for cfg in (PlainConfig(16, 64, 32, split_k=3), PlainConfig(2, 64, 32, split_k=2, use_dot=False)):
        # the interpreter runs each row block in turn: the 33-row cases cost too much for what they add
        if m <= 16:
            check(plain_gemm(x, state, bias, config=cfg, interpret=True), x, mw, bias)
    dense = dequantize_marlin(mw)
    assert torch.equal(
        plain_dequantize(state, F32, interpret=True), dense if state.perm is None else dense[state.perm]
    )


@pytest.mark.parametrize(
    "config,k,group,act",
    [
        (GemmConfig(16, 64, 64, split_k=4), 576, 64, None),  # split-K partials + sum, uneven last split
        (GemmConfig(16, 128, 128, split_k=2), 576, -1, None),  # K tail: 576 = 4.5 blocks of 128
        (GemmConfig(32, 64, 128), 256, 64, "gptq"),  # group < block_k: gathered scales without g_idx
        (GemmConfig(2, 64, 64, split_k=3, use_dot=False), 256, 32, None),  # group 32, FMA path, split-K
    ],
)
def test_triton_gemm_explicit_configs(config, k, group, act):
    mw = make_weight(k, 128, group, zp=True, act=act)
    x = activations(5, k, F16)
    bias = torch.randn(128).to(F16)
    check(w4a16_gemm(x, prepare_marlin(mw), bias, config), x, mw, bias)


def test_triton_8bit_zero_points_and_3d_input():
    """Asymmetric 8-bit is not a vLLM Marlin type, but the layout is defined (docs/marlin.md, "Zero points"),
    so it is kept."""
    mw = make_weight(128, 64, 64, bits=8)
    zp = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    mw = dataclasses.replace(mw, zeros=marlin_zero_points(zp, 128, 64, 8))
    x = activations(6, 128, F16).reshape(2, 3, 128)
    check(w4a16_gemm(x, prepare_marlin(mw)), x, mw)


@pytest.mark.parametrize(
    "group,zp,act,bits", [(64, True, "random", 4), (-1, False, "gptq", 8), (128, False, None, 4)]
)
def test_triton_dequantize_is_exact(group, zp, act, bits):
    mw = make_weight(256, 192, group, bits, zp, act)
    assert torch.equal(marlin_dequantize(prepare_marlin(mw), F32), dequantize_marlin(mw))


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "marlin"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_triton_prefill_path_dequantizes_then_matmuls(dtype, plain):
    mw = make_weight(256, 128, 64, zp=True, act="gptq", scale_dtype=dtype)
    kernel = TritonW4A16Kernel(dequant_min_m=8, plain=plain)
    assert isinstance(kernel.prepare(mw), PlainState) == plain
    small = ("plain-dot", "plain-dot", "plain-fma") if plain else ("fused-dot", "fused-fma", "fused-fma")
    assert kernel.path(8) == "dequant+matmul" and (kernel.path(3), kernel.path(2), kernel.path(1)) == small
    x = activations(9, 256, dtype)
    bias = torch.randn(128).to(dtype)
    # A dense bf16 weight is rounded to 8 significant bits (~1.2e-3 relative on the output, as in any bf16
    # dequantize-then-GEMM, Marlin's own included); the fused path scales after the dot and stays < 1e-3.
    check(kernel.apply(kernel.prepare(mw), x, bias), x, mw, bias, tol=3e-3 if dtype == BF16 else 1e-3)


@pytest.mark.parametrize("kernel_cls", [CpuDequantKernel, CpuDenseKernel])
@pytest.mark.parametrize(
    "m,k,group,dtype,zp,act,bits",
    [
        (1, 576, 64, F32, False, None, 4),
        (16, 256, 128, F16, True, "gptq", 4),
        (33, 256, 64, BF16, True, "random", 4),
        (3, 128, -1, F32, False, None, 8),
        (2, 256, 64, F32, False, "random", 8),
    ],
)
def test_cpu_kernels_match_reference(kernel_cls, m, k, group, dtype, zp, act, bits):
    mw = make_weight(k, 192, group, bits, zp, act)
    x = activations(m, k, dtype)
    bias = torch.randn(192).to(dtype)
    kernel = kernel_cls()
    out = kernel.apply(kernel.prepare(mw), x, bias)
    check(out, x, mw, bias, tol=1e-5 if dtype == F32 else 1e-3)


def test_select_kernel_prefers_torch_paths_on_cpu_and_triton_by_name():
    mw = make_weight(128, 64)
    assert select_kernel(mw, F32, "cpu").name == "cpu_dequant"
    assert select_kernel(mw, F16, "cpu", name="cpu_dense").name == "cpu_dense"
    assert select_kernel(mw, F16, "cpu", name="triton_w4a16").name == "triton_w4a16"  # interpreter is on
    layer = prepare_w4a16(mw, F16)
    assert isinstance(layer, W4A16Linear) and layer.kernel.name == "cpu_dequant"
    x = activations(4, 128, F16)
    check(layer(x), x, mw)
    check(w4a16_linear(x, mw), x, mw)
    check(w4a16_linear(x, mw, TritonW4A16Kernel()), x, mw)
    with pytest.raises(ValueError, match="K=128"):
        layer(activations(4, 64, F16))
    with pytest.raises(KernelUnavailableError, match="unknown W4A16 kernel 'marlin'"):
        select_kernel(mw, F16, "cpu", name="marlin")


def _fake(bits=4, k=128, n=64) -> MarlinWeight:
    """A MarlinWeight with the given header only: can_implement must decide from metadata, not tensors."""
    z = torch.zeros(1, dtype=torch.int32)
    return MarlinWeight(z, z.float(), None, None, None, bits, 128, k, n)


@pytest.mark.parametrize(
    "mw,dtype,device,why",
    [
        (_fake(bits=3), F16, "cpu", "3-bit"),
        (_fake(k=72), F16, "cpu", "K % 16"),
        (_fake(n=96), F16, "cpu", "N % 64"),
        (_fake(), torch.int8, "cpu", "torch.int8"),
    ],
)
def test_can_implement_reasons_and_select_error_lists_all(mw, dtype, device, why):
    for cls in (TritonW4A16Kernel, CpuDequantKernel, CpuDenseKernel):
        ok, reason = cls.can_implement(mw, dtype, device)
        assert not ok and why in reason
    with pytest.raises(KernelUnavailableError) as err:
        select_kernel(mw, dtype, device)
    for name in ("triton_w4a16", "cpu_dequant", "cpu_dense"):
        assert name in str(err.value)


def test_triton_refuses_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, reason = TritonW4A16Kernel.can_implement(_fake(), F16, "cpu")
    assert not ok and "TRITON_INTERPRET=1" in reason
    with pytest.raises(KernelUnavailableError, match="triton_w4a16: CPU tensors run Triton only"):
        select_kernel(_fake(), F16, "cpu", name="triton_w4a16")
    if not HAS_CUDA:
        ok, reason = TritonW4A16Kernel.can_implement(_fake(), F16, "cuda")
        assert not ok and "CUDA is not available" in reason
        assert not CpuDequantKernel.can_implement(_fake(), F16, "cuda")[0]


_INTERPRETED_RUN = """
import os, sys, torch
{before}
from quantserve.kernels.qweight import QuantizedWeight
from quantserve.kernels.marlin import to_marlin
from quantserve.kernels.reference import relative_error, w4a16_reference
from quantserve.kernels.w4a16_triton import w4a16_gemm, prepare_marlin
assert {triton_loaded} == ("triton" in sys.modules)
os.environ["TRITON_INTERPRET"] = "1"
mw = to_marlin(QuantizedWeight(torch.randint(0, 16, (128, 64), dtype=torch.uint8), torch.rand(2, 64), None, 4, 64))
for m in (1, 5):  # the FMA path (a reduction) and the dot path
    x = torch.randn(m, 128)
    assert relative_error(w4a16_gemm(x, prepare_marlin(mw)), w4a16_reference(x, mw)) < 1e-5
"""


@pytest.mark.parametrize(
    "before,triton_loaded",
    [("", False), ("import triton", True), ("os.environ['TRITON_INTERPRET'] = '1'; import triton", True)],
)
def test_interpreter_works_whichever_was_first_and_kernels_import_no_triton(before, triton_loaded):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _INTERPRETED_RUN.format(before=before, triton_loaded=triton_loaded)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _compile_for_gpu(arch: int, fn, constexprs: dict, num_warps: int, num_stages: int):
    """triton.compile for a GPU target on a machine without one (Triton ships ptxas): lowers, schedules and
    assembles the kernel exactly as a launch on that GPU would, with the 16-divisibility a real launch infers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    names = list(inspect.signature(fn.fn).parameters)
    ints = ("qw_ptr", "zp_ptr", "gidx_ptr", "perm_ptr")
    out = "*fp32" if constexprs.get("PARTIAL") else "*fp16"
    sig = {
        n: "constexpr" if n in constexprs else "*i32" if n in ints else out if n in ("out_ptr", "w_ptr") else
        "*fp32" if n == "ws_ptr" else "*fp16" if n.endswith("_ptr") else "i32"
        for n in names
    }  # fmt: skip
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] != "constexpr" and n != "M"
    }
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    return compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True},
    )


def _stack_bytes(cubin: bytes) -> int | None:
    """Per-thread stack (register spills) from cuobjdump, which ships with Triton; None if it is absent."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


@pytest.mark.parametrize(
    "arch,m,gathered",
    [(90, 1, False), (90, 16, True), (90, 128, False), (80, 2, False), (80, 16, False), (80, 128, True)],
)
def test_gemm_compiles_for_sm80_sm90_without_register_spills(arch, m, gathered, monkeypatch):
    """The interpreter checks the maths; this checks the default configs lower to sm80/sm90 cubins (tl.dot
    shapes, layouts) and fit in registers, which no CPU run can otherwise show."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # tl builtins consult it while compiling too
    cfg = default_config(m, 4096, 4096, 128, sm_count=132, gathered=gathered, major=arch // 10)
    constexprs = dict(
        BITS=4, HAS_ZP=gathered, HAS_PERM=gathered, HAS_GIDX=gathered, HAS_BIAS=cfg.split_k == 1,
        GROUP_MODE=2 if gathered else 1, SCALE_SINGLE=False, USE_DOT=cfg.use_dot, W_FP32=False,
        DOT_PRECISION="tf32", PARTIAL=cfg.split_k > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
    )  # fmt: skip
    gemm, dequant, splitk_sum = _jit_kernels(False)
    kernel = _compile_for_gpu(arch, gemm, constexprs, cfg.num_warps, cfg.num_stages)
    assert _stack_bytes(kernel.asm["cubin"]) in (0, None), cfg
    if m == 1:
        flags = dict(
            BITS=4, HAS_ZP=True, HAS_PERM=True, HAS_GIDX=False, SCALE_SINGLE=False, BLOCK_N=128, BLOCK_K=64
        )
        assert _stack_bytes(_compile_for_gpu(arch, dequant, flags, 4, 1).asm["cubin"]) in (0, None)
        _compile_for_gpu(arch, splitk_sum, dict(HAS_BIAS=True, BLOCK=1024), 4, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 16, 33, 128, 600])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_cuda_kernel_matches_reference(m, dtype):
    for group, zp, act in [(128, False, None), (128, True, "gptq"), (-1, False, None), (64, False, "random")]:
        mw = make_weight(1024, 768, group, zp=zp, act=act, scale_dtype=dtype)
        mw = dataclasses.replace(mw, **{f.name: _cuda(getattr(mw, f.name)) for f in dataclasses.fields(mw)})
        x = activations(m, 1024, dtype).cuda()
        layer = prepare_w4a16(mw, dtype)
        assert layer.kernel.name == "triton_w4a16"
        out = layer(x)
        ref = w4a16_reference(x, mw).to(dtype)
        tol = 3e-3 if dtype == BF16 and layer.kernel.path(m) == "dequant+matmul" else 1e-3  # see prefill test
        assert relative_error(out, ref) < tol, (group, zp, act)


def _cuda(v):
    return v.cuda() if isinstance(v, torch.Tensor) else v
