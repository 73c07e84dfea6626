"""End-to-end decode speed of the torch backend: a Llama-3-8B-shaped model with random weights, 4-bit (Marlin
W4A16 kernels) against fp16, at batch 1 and 16, through the same paged-KV forward the engine uses.

    .venv/bin/python bench/torch_decode.py --out bench/results/torch-decode-<device>.json     # on a CUDA GPU
    .venv/bin/python bench/torch_decode.py --cpu-smoke                                         # tiny shape, CPU

Random weights of real shapes: the device machines have no network, and speed does not depend on the values.
Timing: CUDA events around `--steps` decode steps after `--warmup` steps, each step one token for every sequence,
with `--ctx` tokens already in the cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192,
)  # fmt: skip
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def build(cfg: dict, bits: int | None, dtype: torch.dtype, device: torch.device):
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.backends.torch.weights import _empty_model, _set_module, decoder_linears
    from quantserve.kernels.qweight import QuantizedWeight

    args = ModelArgs.from_hf_config(cfg)
    model = _empty_model(args, dtype, device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if bits:
        g = torch.Generator(device="cpu").manual_seed(0)
        for prefix in decoder_linears(model):
            lin = model.get_submodule(prefix)
            k, n = lin.in_features, lin.out_features
            qw = QuantizedWeight(
                torch.randint(0, 1 << bits, (k, n), dtype=torch.uint8, generator=g),
                torch.rand(k // 128, n, generator=g).half() * 0.01, None, bits, 128,
            )  # fmt: skip
            _set_module(
                model, prefix, QuantLinear.from_quantized(qw, None, dtype=dtype, device=device, name=prefix)
            )
    return model.eval()


def decode_speed(model, batch: int, ctx: int, steps: int, warmup: int, device: torch.device) -> float:
    """Decode tokens/s of `batch` sequences at about `ctx` tokens of context, each step laid out by the runner's
    own prepare_step (so its host work is counted) and run through the paged forward."""
    from quantserve.backends.torch.model import KVCache
    from quantserve.backends.torch.step import prepare_step
    from quantserve.core.detokenizer import IncrementalDetokenizer
    from quantserve.core.sampling_params import SamplingParams
    from quantserve.core.sequence import Sequence

    a, bs = model.args, 16
    blocks_per_seq = -(-(ctx + steps + warmup + 1) // bs)
    dtype = model.model.embed_tokens.weight.dtype
    for layer in model.model.layers:
        layer.self_attn.cache = KVCache(
            batch * blocks_per_seq * bs, a.num_key_value_heads, a.head_dim, dtype, device
        )
    seqs = []
    for i in range(batch):
        s = Sequence(str(i), [1] * (ctx + 1), SamplingParams(), IncrementalDetokenizer(), 1 << 30)
        s.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        s.num_computed = ctx  # as if the prompt were in the cache (its values do not change the cost)
        seqs.append(s)

    def step() -> None:
        b = prepare_step([(s, 1) for s in seqs], bs, device)
        hidden = model(b.input_ids, b.positions, b, max_position=seqs[0].num_computed)
        model.compute_logits(hidden[b.logits_index]).argmax(-1)
        for s in seqs:
            s.num_computed += 1
            s.tokens.append(1)

    with torch.inference_mode():
        for _ in range(warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="a tiny model on the CPU, to check the script runs"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    cfg, dtype = (TINY, torch.float32) if smoke else (LLAMA3_8B, torch.float16)
    rows = []
    for bits in (None, 4):
        model = build(cfg, bits, dtype, device)
        for batch in (int(b) for b in args.batches.split(",")):
            tps = decode_speed(model, batch, args.ctx, args.steps, args.warmup, device)
            rows.append({"weights": f"int{bits}" if bits else str(dtype).removeprefix("torch."), "batch": batch,
                         "tok_per_s": round(tps, 1)})  # fmt: skip
            print(rows[-1], flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "shape": "tiny (smoke)" if smoke else "Llama-3-8B", "ctx": args.ctx,
        "steps": args.steps, "rows": rows,
    }  # fmt: skip
    fp = {r["batch"]: r["tok_per_s"] for r in rows if r["weights"] != "int4"}
    print("| weights | batch | tok/s | vs fp16 |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['weights']} | {r['batch']} | {r['tok_per_s']} | {r['tok_per_s'] / fp[r['batch']]:.2f}x |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
