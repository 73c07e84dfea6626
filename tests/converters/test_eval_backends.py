"""Perplexity and KL on the torch backend against llama.cpp's, and `quantserve convert`'s quality summary."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner

from quantserve.backends.torch.tokenizer import HFTokenizer
from quantserve.cli import main
from quantserve.conversion_quality import builtin_text
from quantserve.errors import BackendUnavailableError, ConfigError
from quantserve.evaluate import Scorer, kl_divergence, perplexity

N_CTX = 128  # short chunks keep the CPU forward passes cheap; the conventions are the same at 512
# One thread: spinning thread pools (llama.cpp's, torch's OpenMP) slow down ~5x on a busy 2-core machine.
T1 = {"threads": 1}
TEXT = builtin_text()
SHORT = TEXT[:1400]  # ~280 tokens: two chunks of 128


@pytest.fixture(autouse=True)
def _torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)  # the torch scorer sets them for the process


@pytest.fixture(scope="module")
def tiny(tiny_llama_hf):
    return tiny_llama_hf


def test_torch_tokens_and_perplexity_match_llamacpp(smollm2_gguf, smollm2_hf):
    """The fp32 HF checkpoint holds exactly the GGUF's dequantized weights: one model on both backends. llama.cpp
    differs only in its Q4_1 matmuls (activations rounded to 8 bits): ~0.3 % on GPL-3 at n_ctx 512."""
    a = Scorer(smollm2_gguf, n_ctx=N_CTX, **T1)
    try:
        assert HFTokenizer.from_dir(smollm2_hf).tokenize(TEXT, add_special=True, parse_special=False) == (
            a.tokenize(TEXT)
        )
    finally:
        a.close()
    text = TEXT[:2800]  # four chunks
    ref = perplexity(smollm2_gguf, text, n_ctx=N_CTX, **T1)
    got = perplexity(smollm2_hf, text, n_ctx=N_CTX, backend="torch", **T1)
    assert (got.n_chunks, got.n_scored) == (ref.n_chunks, ref.n_scored) and got.n_chunks >= 4
    assert got.scored_by == "torch (cpu, float32)" and ref.scored_by == "llama.cpp"
    assert abs(got.ppl / ref.ppl - 1) < 0.015, (got.ppl, ref.ppl)


def test_kl_of_a_model_with_itself_is_zero_on_torch(tiny):
    r = kl_divergence(tiny, tiny, SHORT, n_ctx=N_CTX, backend="torch", **T1)
    assert r.n_scored == 2 * (N_CTX // 2 - 1) and r.scored_by.startswith("torch")
    assert abs(r.mean_kl) < 1e-6 and r.top1_agreement == 1.0 and r.ppl_base == pytest.approx(r.ppl_model)


def test_backend_errors_say_what_to_do(smollm2_gguf):
    with pytest.raises(BackendUnavailableError, match="is GGUF; the torch backend reads HF checkpoints"):
        Scorer(smollm2_gguf, "torch")
    with pytest.raises(ConfigError, match="choose one of llamacpp, torch"):
        Scorer(smollm2_gguf, "onnx")
    r = CliRunner().invoke(main, ["eval", "ppl", str(smollm2_gguf), "--text", __file__, "--backend", "onnx"])
    assert r.exit_code == 2 and "'llamacpp', 'torch'" in r.output


def test_cli_eval_ppl_on_torch_converts_a_gguf(smollm2_gguf, tmp_path):
    """A GGUF scored by torch goes through an fp32 HF conversion: the perplexity is llama.cpp's."""
    path = tmp_path / "eval.txt"
    path.write_text(SHORT, encoding="utf-8")
    args = [
        "eval",
        "ppl",
        str(smollm2_gguf),
        "--text",
        str(path),
        "--ctx",
        str(N_CTX),
        "--backend",
        "torch",
        "--threads",
        "1",
    ]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "scored by: torch (cpu, float32)" in r.stdout and "(scored as " in r.stdout
    ppl = float(re.search(r"PPL = ([\d.]+)", r.stdout).group(1))
    ref = perplexity(smollm2_gguf, SHORT, n_ctx=N_CTX, **T1).ppl
    assert abs(ppl / ref - 1) < 0.015, (ppl, ref)


def _summary(stdout: str) -> tuple[float, float, float, float, float, str, float]:
    """(MiB, bits/weight, PPL source, PPL output, mean KL, scorer, seconds) from convert's one quality line."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("quality:")]
    assert len(lines) == 1, stdout
    m = re.fullmatch(
        r"quality: ([\d.]+) MiB, ([\d.]+) bits/weight, PPL ([\d.]+) -> ([\d.]+) \([-+][\d.]+ %\), mean KL "
        r"([\d.e-]+) against the source \(\d+ tokens of the built-in text, (.+), ([\d.]+) s\)",
        lines[0],
    )
    assert m, lines[0]
    *numbers, scorer, seconds = m.groups()
    return (*map(float, numbers), scorer, float(seconds))


def test_convert_to_q8_0_prints_a_one_line_quality_summary(smollm2_hf, tmp_path):
    out = tmp_path / "smol.q8_0.gguf"
    args = ["convert", "--src", str(smollm2_hf), "--dst", str(out), "--quant", "q8_0", "--threads", "1"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    mib, bpw, ppl_src, ppl_out, kl, scorer, seconds = _summary(r.stdout)
    assert mib == pytest.approx(out.stat().st_size / 2**20, abs=0.05) and scorer == "llama.cpp"
    assert 8.5 < bpw < 9  # q8_0 is 8.5 bits per weight; the tokenizer in the header adds a little
    assert 0 < kl < 0.02 and abs(ppl_out / ppl_src - 1) < 0.03 and seconds > 0


def test_check_and_summary_of_a_quantized_directory_agree(tiny, tmp_path, monkeypatch):
    """--check scores a GPTQ directory by llama.cpp through its exact dequantized weights, the summary by the torch
    backend straight from the checkpoint: the same KL."""
    monkeypatch.setenv("QUANTSERVE_CACHE", str(tmp_path / "cache"))  # --check caches the source's GGUF
    rtn = ["convert", "--src", str(tiny), "--quant", "rtn", "--group-size", "32", "--threads", "1"]
    r = CliRunner().invoke(main, [*rtn, "--dst", str(tmp_path / "rtn"), "--check"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(("| source", "| output"))]
    assert len(rows) == 2 and "by llama.cpp" in r.stdout and "quality:" not in r.stdout, r.stdout
    src_bpw, out_bpw = (float(row.strip("|").split("|")[3]) for row in rows)
    kl = float(rows[1].strip("|").split("|")[6])
    assert src_bpw == pytest.approx(32, abs=0.1) and out_bpw < src_bpw and kl > 0

    r = CliRunner().invoke(main, [*rtn, "--dst", str(tmp_path / "rtn2")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    *_, summary_kl, scorer, _ = _summary(r.stdout)
    assert scorer == "torch (cpu, float32)" and summary_kl == pytest.approx(kl, abs=1e-5)


def test_no_summary_and_lossless_conversions_print_none(tiny, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the summary ran")

    monkeypatch.setattr("quantserve.conversion_quality.conversion_quality", refuse)
    gguf = tmp_path / "tiny.f16.gguf"
    for args in (
        ["--src", str(tiny), "--dst", str(gguf), "--quant", "f16", "--no-summary"],
        ["--src", str(gguf), "--dst", str(tmp_path / "hf")],  # GGUF -> HF: nothing lost, nothing to measure
    ):
        r = CliRunner().invoke(main, ["convert", *args], catch_exceptions=False)
        assert r.exit_code == 0 and "quality:" not in r.stdout, r.output
