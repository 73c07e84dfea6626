"""`quantserve run DIR --backend torch` on CPU, through the official OpenAI client: the full-precision SmolLM2, and
GPTQ and AWQ versions of it made by quantserve's own quantizers, each answer the Paris question."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.conftest import PARIS, THREADS, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quantized(smollm2_hf, tmp_path_factory):
    """GPTQ and AWQ (4-bit, group 64: SmolLM2's K = 576 is not a multiple of 128) from a short calibration run."""
    from quantserve.converters.calibration.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("quantized")
    return {
        m: quantize_checkpoint(
            smollm2_hf, out / m, m, group_size=64, n_samples=1, seq_len=128, progress=False
        ).path
        for m in ("gptq", "awq")
    }


def ask_paris(base_url: str, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    if stream:
        parts = client.chat.completions.create(
            model=model, messages=PARIS, temperature=0, max_tokens=24, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    r = client.chat.completions.create(model=model, messages=PARIS, temperature=0, max_tokens=24)
    return r.choices[0].message.content


def test_full_precision_torch_backend(smollm2_hf, tmp_path):
    srv = start_server(
        tmp_path, str(smollm2_hf), "--backend", "torch", "--ctx-size", "1024", "--max-num-seqs", "2"
    )
    try:
        assert "Paris" in ask_paris(srv.base_url)
        assert ask_paris(srv.base_url, stream=True) == ask_paris(srv.base_url)
        card = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
        assert card["meta"]["backend"] == "torch" and card["meta"]["format"] == "safetensors"
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            json={
                "messages": PARIS,
                "response_format": {"type": "json_object"},
                "max_tokens": 64,
                "temperature": 0,
            },
            timeout=300,
        ).json()
        assert r["choices"][0]["finish_reason"] == "stop"  # the grammar let the model close the object
        assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    finally:
        assert srv.stop() == 0
    assert "backend torch" in srv.log()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_torch_backend(quantized, method, tmp_path):
    srv = start_server(tmp_path, str(quantized[method]), "--backend", "torch", "--ctx-size", "1024")
    try:
        assert "Paris" in ask_paris(srv.base_url)
        card = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
        assert card["meta"]["format"] == method
    finally:
        assert srv.stop() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, auto picks the torch backend")
def test_auto_serves_gptq_through_llamacpp_without_cuda(quantized, tmp_path):
    """No GPU: auto dequantizes the GPTQ checkpoint and serves it with llama.cpp (q8_0), and says so."""
    srv = start_server(
        tmp_path, str(quantized["gptq"]), "--ctx-size", "1024", "--cache-dir", str(tmp_path / "c")
    )
    try:
        assert "Paris" in ask_paris(srv.base_url)
        assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["meta"]["backend"] == "llamacpp"
    finally:
        assert srv.stop() == 0
    assert "backend: llamacpp — no CUDA GPU" in srv.log()  # the plan, as the load logs it


def test_eval_ppl_scores_a_gptq_directory(quantized):
    """`quantserve eval ppl DIR` on a quantized directory: exact dequantization, then llama.cpp's perplexity."""
    from importlib.resources import files

    from click.testing import CliRunner

    from quantserve.cli import main

    text = str(files("quantserve") / "data/eval.txt")
    args = ["eval", "ppl", str(quantized["gptq"]), "--text", text, "--threads", str(THREADS)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    ppl = float(r.output.split("PPL = ")[1].split()[0])
    assert 5 < ppl < 100  # a working 4-bit model on English prose (SmolLM2 full precision: ~25 on this text)
