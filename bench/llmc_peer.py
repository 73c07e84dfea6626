"""Quantize a dense HF checkpoint with llm-compressor: the peer in the quantization benchmark.

Runs in its own venv (bench/.build/llmc; never a quantserve dependency):

    bench/.build/llmc/bin/python bench/llmc_peer.py --src DIR --dst DIR \
        --method gptq|awq --bits 4 --group-size 64 --sym|--asym --tokens TOKENS.json \
        [--dampening-frac 0.01] [--actorder none|static|group] [--scale-dtype float16]
        [--threads 2]

TOKENS.json is a JSON list of lists of token ids ([n_samples][seq_len]), the same
calibration tokens our own quantizer uses; they go to `oneshot` as input_ids with an
all-ones attention_mask (no tokenization on llm-compressor's side).  The output is a
compressed-tensors (pack-quantized) checkpoint plus the source's tokenizer files.
Scales come out in the model's dtype (float32 for an fp32 source); --scale-dtype float16
rounds them to fp16 during calibration and stores them as fp16, like our own writer.
The last stdout line is JSON: {"seconds": oneshot wall time, "llmcompressor": version,
"dst": path}.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True)
    p.add_argument("--dst", required=True)
    p.add_argument("--method", choices=("gptq", "awq"), required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    sym = p.add_mutually_exclusive_group(required=True)
    sym.add_argument("--sym", dest="symmetric", action="store_true")
    sym.add_argument("--asym", dest="symmetric", action="store_false")
    p.add_argument("--tokens", required=True)
    p.add_argument("--dampening-frac", type=float, default=0.01)
    p.add_argument("--actorder", choices=("none", "static", "group"), default="none")
    p.add_argument("--scale-dtype", choices=("model", "float16"), default="model")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def build_recipe(args):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=args.bits,
        type="int",
        symmetric=args.symmetric,
        strategy="group",
        group_size=args.group_size,
        scale_dtype=torch.float16 if args.scale_dtype == "float16" else None,
    )
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if args.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        actorder = None if args.actorder == "none" else args.actorder
        return GPTQModifier(
            config_groups=groups, ignore=["lm_head"], actorder=actorder, dampening_frac=args.dampening_frac
        )

    # In 0.14 AWQ is a pure transform (smoothing-scale search); the quantization itself
    # (RTN with the smoothed weights) is a QuantizationModifier that follows it.
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    # Workaround: on a CPU-only torch, AWQ's IntermediatesCache.pin_memory raises
    # "Cannot access accelerator device when none is available"; pinning only speeds
    # host-to-device copies, so it is a no-op here.
    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    return [AWQModifier(duo_scaling=True), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def cast_scales_fp16(dst):
    """scale_dtype only rounds the scales; they are still saved in the model dtype."""
    from safetensors.torch import load_file, save_file

    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for k, t in tensors.items():
            if k.endswith("weight_scale"):
                assert torch.equal(t, t.half().to(t.dtype)), k  # lossless by construction
                tensors[k] = t.half()
        save_file(tensors, f, metadata={"format": "pt"})


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)

    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    tokens = json.loads(Path(args.tokens).read_text())
    n_samples, seq_len = len(tokens), len(tokens[0])
    assert all(len(t) == seq_len for t in tokens), "token rows must have equal length"
    dataset = Dataset.from_dict({"input_ids": tokens, "attention_mask": [[1] * seq_len for _ in tokens]})

    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32)
    recipe = build_recipe(args)

    t0 = time.perf_counter()
    oneshot(
        model=model,
        tokenizer=args.src,
        recipe=recipe,
        dataset=dataset,
        num_calibration_samples=n_samples,
        max_seq_length=seq_len,
        shuffle_calibration_samples=False,
    )
    seconds = time.perf_counter() - t0

    dst = Path(args.dst)
    model.save_pretrained(dst, save_compressed=True)
    if args.scale_dtype == "float16":
        cast_scales_fp16(dst)
    for name in TOKENIZER_FILES:
        if (Path(args.src) / name).exists():
            shutil.copy2(Path(args.src) / name, dst / name)
    print(
        json.dumps(
            {"seconds": round(seconds, 2), "llmcompressor": llmcompressor.__version__, "dst": str(dst)}
        )
    )


if __name__ == "__main__":
    main()
