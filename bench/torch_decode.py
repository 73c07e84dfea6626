"""Decode speed of the torch backend: a Llama-3-8B-shaped model with random weights, 4-bit (Marlin W4A16 kernels)
and fp16, at batch 1, 16 and 64, each step through the runner's own `execute` (host layout, the paged forward,
greedy sampling), eager and replayed from CUDA graphs.

`--shape qwen3-30b-a3b --layers 12` does the same for a mixture of experts (128 experts of 768, top-8): 4-bit
experts stacked for the grouped kernel (kernels/w4a16_moe.py), against fp16 experts looped over.

    python bench/torch_decode.py --out decode.json                 # on a CUDA GPU
    python bench/torch_decode.py --cpu-smoke                       # tiny shape, CPU, eager only

Random weights of real shapes: the device machines have no network, and speed does not depend on the values.
Timing: host clock around `--steps` decode steps after `--warmup` steps (each step ends in the sampler reading
the tokens back, so the clock sees finished work), each step one token for every sequence, with `--ctx` tokens
already in the cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192,
)  # fmt: skip
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
)  # fmt: skip (Qwen/Qwen3-30B-A3B config.json)
# Gemma-3-12B-shaped (hidden 3840, 48 layers of 16 heads over 8 KV heads of 256, five layers of six within 1024
# tokens, q/k norms, local rope 10k, global 1M scaled x8): its windowed layers read 1024 of the context
GEMMA3_12B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=3840,
    intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    query_pre_attn_scalar=256, sliding_window=1024, rms_norm_eps=1e-6, max_position_embeddings=131072,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
)  # fmt: skip
SHAPES = {"llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "gemma3-12b": GEMMA3_12B}
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def build(cfg: dict, bits: int | None, dtype: torch.dtype, device: torch.device):
    """The model with random weights; with `bits`, every decoder linear is a random `bits`-bit GPTQ-style weight
    (group 128) repacked to Marlin on the device, and never held dense."""
    from quantserve.backends.torch.fuse import fuse_projections
    from quantserve.backends.torch.model import ModelArgs
    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.backends.torch.weights import _empty_model, _set_module
    from quantserve.kernels.qweight import QuantizedWeight

    args = ModelArgs.from_hf_config(cfg)
    linears = LINEARS[:4] if args.num_experts else LINEARS
    prefixes = [f"model.layers.{i}.{name}" for i in range(args.num_hidden_layers) for name in linears]
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(args.num_hidden_layers)
               for e in range(args.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
    model = _empty_model(args, dtype, device, drop=prefixes + experts if bits else ())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if bits:
        g = torch.Generator(device=device).manual_seed(0)
        shapes = {"q_proj": (args.hidden_size, args.num_attention_heads * args.head_dim),
                  "k_proj": (args.hidden_size, args.num_key_value_heads * args.head_dim),
                  "o_proj": (args.num_attention_heads * args.head_dim, args.hidden_size),
                  "gate_proj": (args.hidden_size, args.intermediate_size),
                  "down_proj": (args.intermediate_size, args.hidden_size)}  # fmt: skip
        shapes["v_proj"], shapes["up_proj"] = shapes["k_proj"], shapes["gate_proj"]
        for prefix in prefixes:
            k, n = shapes[prefix.rsplit(".", 1)[1]]
            qw = QuantizedWeight(
                torch.randint(0, 1 << bits, (k, n), dtype=torch.uint8, generator=g, device=device),
                (torch.rand(k // 128, n, generator=g, device=device) * 0.01).half(), None, bits, 128,
            )  # fmt: skip
            _set_module(
                model, prefix, QuantLinear.from_quantized(qw, None, dtype=dtype, device=device, name=prefix)
            )
        for layer in model.model.layers if args.num_experts else ():
            layer.mlp.grouped = (
                random_experts(args, bits, args.hidden_size, 2 * args.moe_intermediate_size, g),
                random_experts(args, bits, args.moe_intermediate_size, args.hidden_size, g),
            )
            layer.mlp.experts = torch.nn.ModuleList()  # fmt: skip
    fuse_projections(model)  # as the server's loader does
    return model.eval()


def random_experts(args, bits: int, k: int, n: int, g: torch.Generator):
    """Every expert's weight of one projection, stacked in the grouped kernel's layout (what fuse.group_experts
    makes of int4 experts), drawn at random on the device: 128 experts of a layer in one call."""
    from quantserve.kernels.w4a16_moe import MoeState

    e, device = args.num_experts, g.device
    words = torch.randint(
        -(2**31), 2**31 - 1, (e, k * bits // 32, n), generator=g, device=device, dtype=torch.int32
    )
    scales = (torch.rand(e, k // 128, n, generator=g, device=device) * 0.01).half()
    return MoeState(words, scales, None, bits, 128, k, n)


def decode_speed(model, batch: int, ctx: int, steps: int, warmup: int, runner) -> float:
    """Decode tokens/s of `batch` sequences at about `ctx` tokens of context through `runner.execute`."""
    from quantserve.core.detokenizer import IncrementalDetokenizer
    from quantserve.core.sampling_params import SamplingParams
    from quantserve.core.sequence import Sequence

    bs = runner.block_size
    per_seq = -(-(ctx + steps + warmup + 1) // bs)
    seqs = []
    for i in range(batch):
        s = Sequence(
            str(i), [1] * (ctx + 1), SamplingParams(temperature=0.0), IncrementalDetokenizer(), 1 << 30
        )
        s.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        s.num_computed = ctx  # as if the prompt were in the cache (its values do not change the cost)
        seqs.append(s)
    plan = [(s, 1) for s in seqs]

    def step() -> None:
        for s, tok in zip(seqs, runner.execute(plan), strict=True):
            s.num_computed += 1  # the scheduler's part of a step
            s.tokens.append(tok.token)

    for _ in range(warmup):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - t)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/bench/test_gpu_script.py parses bench/gpu/run.py's commands with it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the model's shape")
    ap.add_argument("--layers", type=int, default=0, help="keep only this many decoder layers (0: all)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--modes", default="eager,graphs", help="eager and/or graphs (CUDA only)")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="a tiny model on the CPU, to check the script runs"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON")
    return ap


def main(argv: list[str] | None = None) -> None:
    from quantserve.backends.torch.runner import TorchRunner
    from quantserve.core.settings import EngineSettings

    ap = parser()
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    cfg, dtype = (TINY, torch.float32) if smoke else (SHAPES[args.shape], torch.float16)
    if smoke and args.shape == "qwen3-30b-a3b":  # the MoE's tiny twin
        cfg = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_experts=8,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    if smoke and args.shape == "gemma3-12b":  # Gemma's, with a window shorter than the context
        cfg = dict(GEMMA3_12B, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=16)  # fmt: skip
    if args.layers or smoke:
        cfg = dict(cfg, num_hidden_layers=args.layers or 2)
    batches = [int(b) for b in args.batches.split(",")]
    modes = ["eager"] if smoke else args.modes.split(",")
    rows, errors = [], []
    for bits in (4, None):
        weights = f"int{bits}" if bits else str(dtype).removeprefix("torch.")
        t0 = time.perf_counter()
        model = build(cfg, bits, dtype, device)
        print(f"{weights} model built in {time.perf_counter() - t0:.1f} s", flush=True)
        for mode in modes:
            try:
                kv = max(batches) * (args.ctx + args.steps + args.warmup + 32)
                settings = EngineSettings.from_options(
                    ctx_size=args.ctx + args.steps + args.warmup + 16, max_num_seqs=max(batches), kv_size=kv,
                    cuda_graphs=mode == "graphs",
                )  # fmt: skip
                t0 = time.perf_counter()
                runner = TorchRunner(model, None, settings, device)
                setup_s = time.perf_counter() - t0
                for batch in batches:
                    tps = decode_speed(model, batch, args.ctx, args.steps, args.warmup, runner)
                    rows.append({"weights": weights, "mode": mode, "batch": batch, "tok_per_s": round(tps, 1),
                                 "runner_setup_s": round(setup_s, 1)})  # fmt: skip
                    print(rows[-1], flush=True)
                del runner
            except Exception as exc:  # noqa: BLE001 - one mode failing must not hide the others' numbers
                errors.append(f"{weights} {mode}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            for layer in model.model.layers:
                layer.self_attn.cache = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "shape": ("tiny (smoke) " if smoke else "") + args.shape, "ctx": args.ctx,
        "layers": cfg["num_hidden_layers"],
        "steps": args.steps, "rows": rows, "errors": errors,
    }  # fmt: skip
    print("| weights | mode | batch | tok/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['mode']} | {r['batch']} | {r['tok_per_s']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=2)
    raise SystemExit(1 if errors else 0)


if __name__ == "__main__":
    main()
