"""Images on both backends: the time to encode one 336x336 image, and the time to first token of a chat with it,
llama.cpp (libmtmd) against torch, on the same LLaVA-shaped random weights, in one run.

Usage: .venv/bin/python bench/vision.py [--rounds 5] [--threads 2]
Writes bench/results/vision-<date>.md and .json.

The model: SmolLM2-135M's shape and tokenizer for the language model (576 wide, 30 layers), a ViT-B-sized CLIP tower
(768 wide, 12 layers) at 336 px in 14 px patches (576 image tokens), LLaVA 1.5's two-layer projector; random
weights (no real LLaVA can be downloaded here), fp32 everywhere: the HF checkpoint on the torch backend, our
converter's f32 text GGUF and f32 mmproj on llama.cpp. Encode time is measured in process (decoded RGB pixels to
embeddings, each backend's own preprocessing included); TTFT at the client, through `quantserve run`, streaming,
one request at a time, a new image each round (nothing cached).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from constrained import hf_checkpoint  # noqa: E402
from prefix_cache import ttft  # noqa: E402
from serving import ServerDef, free_port, machine_info, save_record, start, stop, versions, wait_serving  # noqa: E402

from quantserve.core.multimodal import Image  # noqa: E402
from quantserve.registry import find_models_toml, load_registry, resolve  # noqa: E402
from tests.fixtures.vision import build_tiny_llava  # noqa: E402

BACKENDS = ("llamacpp", "torch")


def picture(seed: int) -> tuple[bytes, Image]:
    """A 336x336 PNG of noise and a block of colour, different for every seed."""
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (336, 336, 3), dtype=np.uint8)
    rgb[:120, :200] = rng.integers(0, 256, 3, dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue(), Image(buf.getvalue(), rgb)


def build(dst: Path) -> dict[str, Path]:
    """The model in HF form (torch) and as f32 GGUFs (llama.cpp)."""
    from click.testing import CliRunner

    from quantserve.cli import main

    smollm2 = hf_checkpoint(resolve("smollm2", load_registry(find_models_toml(None))).path)
    hf = build_tiny_llava(
        dst / "llava-smollm2", smollm2, text_hidden=576, text_layers=30, text_heads=9, kv_heads=3,
        intermediate=1536, vision_hidden=768, vision_layers=12, vision_heads=12,
    )  # fmt: skip
    args = ["convert", "--src", str(hf), "--dst", f"{dst}/gguf/", "--quant", "f32", "--mmproj-type", "f32"]
    result = CliRunner().invoke(main, args)
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    text = next(p for p in (dst / "gguf").glob("*.gguf") if not p.name.startswith("mmproj-"))
    return {"torch": hf, "llamacpp": text}


def encode_times(backend: str, model: Path, rounds: int, threads: int) -> list[float]:
    """Seconds to turn one image's decoded pixels into embeddings, in process."""
    import torch

    from quantserve.llm import load

    llm = load(str(model), backend=backend, threads=threads, ctx_size=1024, max_num_seqs=1)
    runner = llm._runner
    try:
        times = []
        for rnd in range(rounds + 1):  # the first is a warm-up
            _, img = picture(1000 + rnd)
            t0 = time.perf_counter()
            if backend == "llamacpp":
                runner._images.vision.encode(img)
            else:
                from quantserve.vision.preprocess import pixel_values

                pixels = torch.from_numpy(pixel_values(img, runner.image_config))[None]
                with torch.inference_mode():
                    runner.vision_model(pixels)
            times.append(time.perf_counter() - t0)
        return times[1:]
    finally:
        llm.close()


def image_ttft(base_url: str, png: bytes) -> float:
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "text", "text": "Describe the image."},
    ]
    return ttft(base_url, [{"role": "user", "content": content}])


def ttfts(backend: str, model: Path, rounds: int, threads: int, logs: Path) -> list[float]:
    port = free_port()
    cmd = (sys.executable, "-m", "quantserve.cli", "run", str(model), "--backend", backend, "--threads",
           str(threads), "--max-num-seqs", "1", "--ctx-size", "1024", "--port", str(port), "--log-level",
           "warning")  # fmt: skip
    sd = ServerDef(backend, cmd, port, ignore_eos=True)
    log = logs / f"{backend}.log"
    proc = start(sd, log)
    try:
        wait_serving(sd, proc, log, 300)
        url = f"http://127.0.0.1:{port}"
        image_ttft(url, picture(0)[0])  # warm-up
        out = []
        for rnd in range(rounds):
            out.append(image_ttft(url, picture(2000 + rnd)[0]))
            print(f"{backend:9s} round {rnd}: TTFT {1000 * out[-1]:.0f} ms", flush=True)
        return out
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qs-vision-"))
    models = build(work)
    encode = {b: encode_times(b, models[b], args.rounds, args.threads) for b in BACKENDS}
    for b in BACKENDS:
        print(f"{b:9s} encode: " + ", ".join(f"{1000 * t:.0f}" for t in encode[b]) + " ms", flush=True)
    first = {b: ttfts(b, models[b], args.rounds, args.threads, work) for b in BACKENDS}
    write(args, encode, first)


def write(args, encode: dict[str, list[float]], first: dict[str, list[float]]) -> None:
    stamp = dt.datetime.now(dt.UTC)
    name = f"vision-{stamp:%Y-%m-%d}"
    med_e = {b: statistics.median(v) for b, v in encode.items()}
    med_t = {b: statistics.median(v) for b, v in first.items()}
    info = machine_info()
    lines = [
        "# Images: encode time and time to first token, llama.cpp against torch",
        "",
        f"Measured {stamp:%Y-%m-%d %H:%M} UTC. Command: `.venv/bin/python bench/vision.py --rounds {args.rounds} "
        f"--threads {args.threads}`.",
        "",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; versions: "
        + ", ".join(f"{k} {v}" for k, v in versions(None).items()),
        "",
        "Model: LLaVA 1.5's shape with random weights: SmolLM2-135M's language model (576 wide, 30 layers, its "
        "tokenizer), a ViT-B-sized CLIP tower (768 wide, 12 layers) at 336 px in 14 px patches (576 image tokens), "
        "the two-layer projector; fp32 on both backends (torch: the HF checkpoint; llama.cpp: our converter's f32 "
        f"text GGUF and f32 mmproj). {args.threads} threads. One 336x336 PNG, a new one each round. Encode: decoded "
        "pixels to embeddings in process, each backend's own preprocessing included. TTFT: at the client through "
        "`quantserve run`, streaming, one request at a time (~590 prompt tokens). Medians of the rounds.",
        "",
        "| | llama.cpp | torch | llama.cpp / torch |",
        "|---|---|---|---|",
        f"| image encode | {1000 * med_e['llamacpp']:.0f} ms | {1000 * med_e['torch']:.0f} ms | "
        f"**{med_e['llamacpp'] / med_e['torch']:.2f}** |",
        f"| TTFT with the image | {1000 * med_t['llamacpp']:.0f} ms | {1000 * med_t['torch']:.0f} ms | "
        f"**{med_t['llamacpp'] / med_t['torch']:.2f}** |",
        "",
        "Every round (ms):",
        "",
    ]
    lines += [f"- {b}, encode: " + ", ".join(f"{1000 * x:.0f}" for x in v) for b, v in encode.items()]
    lines += [f"- {b}, TTFT: " + ", ".join(f"{1000 * x:.0f}" for x in v) for b, v in first.items()]
    save_record(args.out, name, lines, {"machine": info, "encode_s": encode, "ttft_s": first})


if __name__ == "__main__":
    main()
