"""Calibrated GGUF (`convert --quant q4_k_m --calib ...`): the block-code codec against llama.cpp's own quantizer
and gguf-py's dequantizer, GPTQ's grid rounding against a plain reference, and one SmolLM2 conversion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from quantserve.converters.calibration.gptq import GPTQ
from quantserve.gguf import codes
from quantserve.gguf.native_quant import ggml_quantize

TYPES = sorted(codes.SUPPORTED)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_codes_read_write_and_grid_match_llama_cpp_blocks(qtype: T) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 512)) * np.linspace(0.1, 3, 512)).astype(np.float32)
    raw = ggml_quantize(x, qtype)  # llama.cpp's own blocks
    c = codes.read_codes(raw, qtype)
    lo, hi = codes.code_range(qtype)
    assert lo <= c.min() and c.max() <= hi and c.max() > c.min()
    assert np.array_equal(codes.write_codes(raw, qtype, c), raw)
    scale, offset = codes.grid(raw, qtype)
    deq = quants.dequantize(raw, qtype).reshape(5, -1)
    np.testing.assert_allclose(scale * c + offset, deq, rtol=1e-6, atol=1e-6)
    # a new code changes that weight alone, to its grid value, and no header byte
    c2 = c.copy()
    c2[3, 300] = lo if c[3, 300] != lo else hi
    raw2 = codes.write_codes(raw, qtype, c2)
    deq2 = quants.dequantize(raw2, qtype).reshape(5, -1)
    assert np.argwhere(deq2 != deq).tolist() == [[3, 300]]
    assert deq2[3, 300] == pytest.approx(scale[3, 300] * c2[3, 300] + offset[3, 300], rel=1e-6, abs=1e-6)
    with pytest.raises(ValueError, match="codes must lie"):
        codes.write_codes(raw, qtype, c + (hi - lo + 1))


def _plain_gptq_on_grid(H, W, S, Off, lo, hi, damp=0.01):
    """GPTQ written plainly: natural column order, no lazy blocks, the OBS update after every column."""
    H = H.double().clone()
    H += damp * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    W = W.double().clone()
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        inv = torch.where(S[:, j] != 0, 1 / S[:, j].double(), 0.0)
        q = torch.clamp(torch.round((W[:, j] - Off[:, j]) * inv), lo, hi)
        Q[:, j] = q
        err = (W[:, j] - (S[:, j] * q + Off[:, j])) / U[j, j]
        W[:, j:] -= err[:, None] * U[j, j:][None, :]
    return Q


def test_round_to_grid_is_gptq_and_beats_nearest_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 24, 96
    X = torch.randn(512, 8, generator=g) @ torch.randn(8, k, generator=g) + 0.2 * torch.randn(
        512, k, generator=g
    )
    W = torch.randn(n, k, generator=g) * 0.05
    raw = ggml_quantize(W.numpy(), T.Q4_0)
    s, o = (torch.from_numpy(a) for a in codes.grid(raw, T.Q4_0))
    gptq = GPTQ(k)
    gptq.add_batch(X)
    H = gptq.H.clone()
    q, wq = gptq.round_to_grid(W, s, o, 0, 15, act_order=False, block_size=32, keep_hessian=True)
    ref = _plain_gptq_on_grid(H, W, s, o, 0, 15)
    assert (q.double() != ref).float().mean() < 0.01  # float64 vs float32 may flip a tie or two
    nearest = torch.clamp(torch.round((W - o) / s), 0, 15) * s + o  # round-to-nearest on the same grid

    def err(wh):
        return float(((W - wh) @ X.T).pow(2).sum())

    q2, wq2 = gptq.round_to_grid(W, s, o, 0, 15, act_order=True)
    assert torch.equal(wq, s * q + o)
    assert err(wq) < 0.8 * err(nearest) and err(wq2) < 0.8 * err(nearest)


def test_calibrated_q4_k_m_on_smollm2_keeps_the_layout_and_lowers_kl(
    smollm2_hf: Path, tmp_path: Path
) -> None:
    """End to end on SmolLM2 with a small calibration set (2 x 256 tokens of the built-in calibration text),
    scored on the --check text (a different one) against the full-precision source."""
    from click.testing import CliRunner

    from quantserve.cli import main as cli
    from quantserve.conversion_quality import builtin_text
    from quantserve.formats import read_gguf_info
    from quantserve.gguf import hf_to_gguf

    f32 = hf_to_gguf(smollm2_hf, tmp_path / "f32.gguf", "f32", progress=False)
    plain = hf_to_gguf(smollm2_hf, tmp_path / "plain.gguf", "q4_k_m", progress=False)
    cal = tmp_path / "cal.gguf"
    args = ["convert", "--src", str(smollm2_hf), "--dst", str(cal), "--quant", "q4_k_m", "--calib", "builtin",
            "--calib-samples", "2", "--calib-seq-len", "256", "--no-summary"]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "Q4_K_M with GPTQ's codes in 210 linears" in r.output and "2 x 256 tokens" in r.output
    a, b = read_gguf_info(plain), read_gguf_info(cal)
    assert [(t.name, t.type_name, t.n_bytes) for t in a.tensors] == [
        (t.name, t.type_name, t.n_bytes) for t in b.tensors
    ]
    assert 0 < cal.stat().st_size - plain.stat().st_size < 512  # the quantize.imatrix.* keys
    assert b.metadata["quantize.imatrix.entries_count"] == 210
    assert b.metadata["quantize.imatrix.file"] == "quantserve"
    (tmp_path / "check.txt").write_text(builtin_text())
    args = ["eval", "kl", "--base", str(f32), "--model", str(plain), "--model", str(cal),
            "--text", str(tmp_path / "check.txt"), "--ctx", "256"]  # fmt: skip
    r = CliRunner().invoke(cli, args)  # the base scored once, each model against it
    assert r.exit_code == 0, r.output
    kl_plain, kl_cal = (
        float(line.split()[3]) for line in r.output.splitlines() if line.startswith("mean KL")
    )
    assert kl_cal < 0.9 * kl_plain, (kl_cal, kl_plain)


def test_calibrated_gguf_errors(smollm2_gguf: Path, smollm2_hf: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from quantserve.cli import main as cli

    def run(*extra: str) -> str:
        r = CliRunner().invoke(cli, ["convert", "--dst", str(tmp_path / "x.gguf"), *extra])
        assert r.exit_code != 0
        assert not (tmp_path / "x.gguf").exists()
        return r.output

    assert "apply to HF -> GGUF" in run("--src", str(smollm2_gguf), "--calib", "builtin")
    assert "f16 has nothing to round" in run("--src", str(smollm2_hf), "--quant", "f16", "--calib", "builtin")
    assert "keeps the file type's own bits" in run("--src", str(smollm2_hf), "--quant", "q4_k_m", "--calib",
                                                   "builtin", "--bits", "8")  # fmt: skip
    assert "--act-order static" in run("--src", str(smollm2_hf), "--quant", "q4_k_m", "--calib", "builtin",
                                       "--act-order", "group")  # fmt: skip
