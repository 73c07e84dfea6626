"""kernels/fp8.py's W8A16 GEMM: FP8 weights decoded in registers equal dequantize-then-matmul, under Triton's
interpreter here (every e4m3 byte, the block, channel and tensor scales, partial blocks, a bias), and the kernel
lowers to sm_80, sm_90 and sm_120 (consumer Blackwell) cubins without spilling registers. See test_w4a16_kernels.py for why TRITON_INTERPRET is
set per test."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton  # noqa: F401 - imported before any test sets TRITON_INTERPRET

from quantserve.kernels import fp8
from quantserve.kernels.fp8 import Fp8Weight
from tests.fixtures.fp8 import quantize_fp8
from tests.kernels.test_w4a16_kernels import _stack_bytes


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _weight(n: int, k: int, block: tuple[int, int], seed: int = 0) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8(torch.randn(n, k, generator=gen), block)
    return Fp8Weight(q, s, block)


def test_every_e4m3_byte_decodes_as_torch_reads_it():
    """One row of K = 256 holding each byte once (but the two NaNs, which no weight holds), scale 1: x = e_k."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)] + [0, 0], dtype=torch.uint8)
    w = Fp8Weight(codes.view(torch.float8_e4m3fn)[None], torch.ones(1, 1), (1, 256))
    got = fp8.fp8_linear(torch.eye(256), w)  # [256, 1]: row k is the value of byte k
    assert torch.equal(got[:, 0], codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize(
    "m,n,k,block",
    [(1, 192, 576, (128, 128)), (5, 64, 128, (128, 128)), (17, 96, 160, (32, 64)), (3, 80, 96, (1, 96)),
     (2, 70, 50, (70, 50))],
)  # fmt: skip
def test_gemm_equals_dequantize_then_matmul(m, n, k, block):
    """Blocks that divide the matrix, partial blocks at both edges (576 = 4.5 x 128), one scale per row, one per
    tensor; an odd M and N."""
    w = _weight(n, k, block)
    gen = torch.Generator().manual_seed(1)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    want = x.double() @ w.dense(torch.float64).T + bias.double()
    got = fp8.fp8_linear(x, w, bias)
    assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()


@pytest.mark.parametrize("arch", [80, 90, 120])
def test_gemm_compiles_for_sm80_sm90_sm120_without_register_spills(arch, monkeypatch):
    """What no CPU run shows: the kernel lowers (tl.dot shapes, the byte arithmetic) and fits in registers, for a
    decode-sized tile (M 16) and a prefill-sized one (M 64), on bf16 activations."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # tl builtins consult it while compiling too
    kernel = fp8._kernel(False)
    names = list(inspect.signature(kernel.fn).parameters)
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    for block_m in (16, 64):
        constexprs = dict(BLOCK_ROWS=128, BLOCK_COLS=128, HAS_BIAS=True, F32_DOT=False, DOT_PRECISION="tf32",
                          BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64)  # fmt: skip
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(names)
            if sig[n] not in ("constexpr",) and n != "M"
        }
        src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
        compiled = compile(
            src,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": 4, "num_stages": 2, "enable_fp_fusion": True},
        )
        assert _stack_bytes(compiled.asm["cubin"]) in (0, None), block_m


def test_fp8_linear_runs_the_kernel_where_it_can_and_both_paths_agree(monkeypatch):
    from quantserve.backends.torch.float_linear import Fp8Linear

    w, bias = _weight(96, 160, (32, 64)), torch.randn(96)
    x = torch.randn(2, 3, 160)  # [batch, tokens, K]
    kernel = Fp8Linear(w, bias, dtype=torch.float32, device=torch.device("cpu"), name="t")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    portable = Fp8Linear(w, bias, dtype=torch.float32, device=torch.device("cpu"), name="t")
    assert kernel.use_kernel and not portable.use_kernel
    want = torch.nn.functional.linear(x.double(), w.dense(torch.float64), bias.double())
    for layer in (kernel, portable):
        got = layer(x)
        assert got.shape == (2, 3, 96) and (got.double() - want).abs().max() < 1e-4 * want.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 16, 33, 128])
def test_cuda_gemm_equals_dequantize_then_matmul(m, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = _weight(4096 + 64, 576, (128, 128))  # partial blocks along both
    gen = torch.Generator().manual_seed(2)
    x, bias = torch.randn(m, 576, generator=gen).to(dtype), torch.randn(4096 + 64, generator=gen).to(dtype)
    cuda = Fp8Weight(w.weight.cuda(), w.scale.cuda(), w.block)
    got = fp8.fp8_linear(x.cuda(), cuda, bias.cuda()).cpu().double()
    want = x.double() @ w.dense(torch.float64).T + bias.double()
    assert (got - want).abs().mean() / want.abs().mean() < 1e-2  # the activations' dtype rounds the output


def test_mxfp4_linear_runs_the_kernel_where_it_can_and_both_paths_agree(monkeypatch):
    """A dense MXFP4 linear (compressed-tensors' MXFP4A16) through kernels/mxfp4.py's GEMM, gpt-oss's experts' one."""
    from quantserve.backends.torch.float_linear import Mxfp4Linear
    from quantserve.kernels import mxfp4

    blocks, scales = mxfp4.quantize(torch.randn(96, 128, generator=torch.Generator().manual_seed(3)))
    w, bias = mxfp4.Mxfp4Weight(blocks, scales), torch.randn(96)
    x = torch.randn(2, 3, 128)
    kernel = Mxfp4Linear(w, bias, dtype=torch.float32, device=torch.device("cpu"), name="t")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    portable = Mxfp4Linear(w, bias, dtype=torch.float32, device=torch.device("cpu"), name="t")
    assert kernel.use_kernel and not portable.use_kernel
    want = torch.nn.functional.linear(x.double(), w.dequantize(torch.float64).T, bias.double())
    for layer in (kernel, portable):
        got = layer(x)
        assert got.shape == (2, 3, 96) and (got.double() - want).abs().max() < 1e-4 * want.abs().max()


def _nvfp4(n: int, k: int, seed: int = 4):
    """Random NVFP4 codes, e4m3 scales and a global scale, as bytes: any byte is a valid pair of e2m1 codes."""
    from quantserve.kernels.nvfp4 import Nvfp4Weight

    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
    return Nvfp4Weight(packed, scales, torch.tensor([2000.0]))


@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (17, 80, 160)])
def test_nvfp4_gemm_equals_dequantize_then_matmul(m, n, k):
    from quantserve.kernels import nvfp4

    w = _nvfp4(n, k)
    gen = torch.Generator().manual_seed(5)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    want = x.double() @ w.dequantize(torch.float64) + bias.double()
    got = nvfp4.nvfp4_linear(x, w, bias)
    assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()


@pytest.mark.parametrize("arch", [80, 90, 120])
def test_nvfp4_gemm_compiles_without_register_spills(arch, monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from quantserve.kernels import nvfp4

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kernel = nvfp4._kernel(False)
    names = list(inspect.signature(kernel.fn).parameters)
    types = {"x_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*bf16", "out_ptr": "*bf16",
             "inv_global": "fp32"}  # fmt: skip
    constexprs = dict(HAS_BIAS=True, F32_DOT=False, DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")}
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    options = {"num_warps": 4, "num_stages": 2, "enable_fp_fusion": True}
    assert _stack_bytes(compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]) in (
        0,
        None,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decodes_every_e4m3_byte_exactly(monkeypatch):
    """The byte arithmetic (tl.exp2 of whole numbers among it) on the GPU's own units: exact, as torch reads them."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)] + [0, 0], dtype=torch.uint8)
    w = Fp8Weight(codes.view(torch.float8_e4m3fn)[None].cuda(), torch.ones(1, 1).cuda(), (1, 256))
    got = fp8.fp8_linear(torch.eye(256, device="cuda"), w)
    assert torch.equal(got[:, 0].cpu(), codes.view(torch.float8_e4m3fn).float())
