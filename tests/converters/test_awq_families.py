"""AWQ on the families whose scales fold somewhere other than Llama's: Phi-3's fused q|k|v and gate|up (v's and
up's rows of the fused linears), and Gemma's norms (held as 1 + w, its MLP reading a norm of its own; the Gemma side
is in test_torch_gemma). Folded, a block computes what it did; at 8 bits, the checkpoint AWQ writes, its rescaled
norms included, is the model it started from."""

from __future__ import annotations

import pytest
import torch
import transformers

from quantserve.converters.calibration.quantize import quantize_checkpoint
from quantserve.quant.dequantize import dequantize_checkpoint
from tests.backends.torch.test_torch_gemma import assert_close_to_dense
from tests.backends.torch.test_torch_model import CASES, TINY
from tests.backends.torch.test_torch_moe import assert_awq_folding_keeps_the_block


@pytest.mark.parametrize("n_kv", [2, 4], ids=["gqa", "no-gqa"])  # without GQA, v's rows take o's scale too
def test_awq_on_phi3s_fused_linears(n_kv, tmp_path):
    config_cls, extra = CASES["phi3"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**{**TINY, "num_key_value_heads": n_kv}, **extra)
    )
    with torch.no_grad():
        for p in model.parameters():  # weights large enough that the logits are far from uniform
            p.normal_(1.0, 0.1) if p.ndim == 1 else p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "src")
    assert_awq_folding_keeps_the_block(tmp_path / "src", TINY["hidden_size"])
    tokens = torch.randint(0, TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_checkpoint(tmp_path / "src", tmp_path / "q8", "awq", bits=8, group_size=32, fmt="gptq",
                        calib_tokens=tokens, progress=False)  # fmt: skip
    dq = dequantize_checkpoint(tmp_path / "q8", tmp_path / "dq", dtype="float32")
    assert_close_to_dense(tmp_path / "src", dq, [i * 3 % TINY["vocab_size"] for i in range(40)])
