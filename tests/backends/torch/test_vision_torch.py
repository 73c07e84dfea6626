"""LLaVA on the torch backend against transformers on the same tiny random weights: the vision features, the logits
of a prompt with an image, greedy tokens; then the engine's side: an image split over prefill chunks, batched with
text-only requests, a 4-bit language model, and the prefix cache keyed on the image's bytes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from quantserve.backends.select import BACKENDS, plan_model
from quantserve.chat import ChatRequest
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.multimodal import Image, expand_images
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.core.settings import EngineSettings
from quantserve.engine.kv import make_kv
from quantserve.engine.llm_engine import LLMEngine
from quantserve.engine.scheduler import SchedulerConfig
from quantserve.formats import detect
from quantserve.llm import LLM
from tests.fixtures.vision import build_tiny_llava, sample_images

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llava_dir(smollm2_hf, tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava", smollm2_hf)


@pytest.fixture(scope="module")
def reference(llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_dir)


def image(name: str) -> Image:
    from PIL import Image as PILImage

    data = sample_images()[name]
    return Image(data, np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB")))


def load(llava_dir, **settings) -> LLM:
    from quantserve.llm import load as load_llm

    return load_llm(str(llava_dir), backend="torch", ctx_size=2048, max_num_seqs=4, **settings)


def chat(llm: LLM, text: str, images: list[Image]):
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return llm.prepare_chat(ChatRequest([{"role": "user", "content": parts}]), images)


@pytest.fixture(scope="module")
def llm(llava_dir):
    llm = load(llava_dir)
    yield llm
    llm.close()


def test_prompt_tokens_match_the_processor(llm, reference):
    """The chat template's <image> becomes as many image tokens as LlavaProcessor writes, where it writes them."""
    _, processor = reference
    img = image("wide.png")
    prompt, tokens, spans = chat(llm, "What is in this picture?", [img])
    from PIL import Image as PILImage

    ref = processor(text=prompt.text, images=PILImage.open(io.BytesIO(img.data)), return_tensors="pt")
    assert tokens == ref["input_ids"][0].tolist()
    assert [(s.offset, s.length) for s in spans] == [(tokens.index(llm.vision.image_token), 576)]


def test_image_features_equal_transformers(llm, reference):
    model, processor = reference
    from PIL import Image as PILImage

    pixels = processor.image_processor(
        [PILImage.open(io.BytesIO(sample_images()[n])) for n in ("tall.jpg", "big.png")], return_tensors="pt"
    )["pixel_values"]
    ours = llm._runner.vision_model(pixels)
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=pixels)
    ref = getattr(ref, "pooler_output", ref)  # transformers 5: an output object holding one tensor per image
    ref = torch.stack(list(ref)) if isinstance(ref, (list, tuple)) else ref
    ref = ref.reshape(ours.shape)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-4), (ours - ref).abs().max()


def prompt_logits(llm: LLM, tokens, spans) -> torch.Tensor:
    """The logits at the prompt's last token, computed by the runner in one prefill step."""
    runner, seen = llm._runner, []
    hook = runner.model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.float()))
    try:
        seq = Sequence(
            "probe", tokens, SamplingParams(max_tokens=1), IncrementalDetokenizer(), 4096, images=spans
        )
        seq.block_table = list(range(-(-len(tokens) // runner.block_size)))
        runner.execute([(seq, len(tokens))])
        runner.release(seq)
    finally:
        hook.remove()
    return seen[0][-1]


@pytest.mark.parametrize("name", ["wide.png", "tall.jpg", "tiny.gif"])
def test_logits_equal_transformers(llm, reference, name):
    model, processor = reference
    img = image(name)
    _, tokens, spans = chat(llm, "Describe the image.", [img])
    ours = prompt_logits(llm, tokens, spans)
    from PIL import Image as PILImage

    pixels = processor.image_processor(PILImage.open(io.BytesIO(img.data)), return_tensors="pt").pixel_values
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens]), pixel_values=pixels).logits[0, -1]
    scale = ref.abs().max()
    assert (ours - ref).abs().max() / scale < 1e-3
    # the image matters: without it (its tokens as plain embeddings) the logits differ by far more
    plain = prompt_logits(llm, tokens, [])
    assert (plain - ref).abs().max() / scale > 1e-2


def greedy(llm: LLM, tokens, spans, n: int = 12) -> list[int]:
    import asyncio

    async def go():
        params = llm.sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [t async for out in llm.generate(tokens, params, images=spans) for t in out.token_ids]

    return asyncio.run(go())


def test_greedy_tokens_equal_transformers(llm, reference):
    model, processor = reference
    img = image("square.webp")
    _, tokens, spans = chat(llm, "What colour is the square?", [img])
    from PIL import Image as PILImage

    pixels = processor.image_processor(PILImage.open(io.BytesIO(img.data)), return_tensors="pt").pixel_values
    with torch.no_grad():
        ref = model.generate(
            input_ids=torch.tensor([tokens]), pixel_values=pixels, max_new_tokens=12, do_sample=False,
            min_new_tokens=12,
        )[0, len(tokens) :].tolist()  # fmt: skip
    assert greedy(llm, tokens, spans) == ref


def engine_run(llm_dir, requests, n_batch: int, max_num_seqs: int, caching: bool = False):
    """Greedy tokens of each (tokens, spans) request, all submitted at once to a fresh engine."""
    opts = {"backend": "torch", "ctx_size": 2048, "max_num_seqs": max_num_seqs, "n_batch": n_batch}
    plan = plan_model(detect(llm_dir), EngineSettings.from_options(**opts))
    loaded = BACKENDS[plan.backend].load(plan)
    runner = loaded.runner
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=n_batch, max_queue_len=64)
    engine = LLMEngine(runner, config, make_kv(runner.kv_spec, prefix_caching=caching))
    out: dict[str, list[int]] = {}
    for i, (tokens, spans) in enumerate(requests):
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add(Sequence(str(i), tokens, sp, IncrementalDetokenizer(), runner.n_ctx, images=spans))
        out[str(i)] = []
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [out[str(i)] for i in range(len(requests))], runner, engine


def test_chunked_and_batched_with_text_requests(llm, llava_dir):
    """An image prefilled in 64-token chunks, next to text-only requests, gives the tokens it gives alone."""
    img = image("wide.png")
    with_image = chat(llm, "Describe the image.", [img])[1:]
    texts = [chat(llm, t, [])[1:] for t in ("Hello there!", "Count to five.", "Name a colour.")]
    alone, _, _ = engine_run(llava_dir, [with_image], n_batch=2048, max_num_seqs=1)
    texts_alone = [engine_run(llava_dir, [t], n_batch=2048, max_num_seqs=1)[0][0] for t in texts]
    mixed, runner, _ = engine_run(llava_dir, [texts[0], with_image, *texts[1:]], n_batch=64, max_num_seqs=4)
    assert mixed[1] == alone[0]
    assert [mixed[0], *mixed[2:]] == texts_alone
    assert runner.images_encoded == 1  # encoded once, though its 576 tokens took 9+ steps


def test_prefix_cache_keys_on_image_bytes(llm, llava_dir):
    """Same text, different images: different answers, no KV shared past the text before the image. The same
    image again: only the tokens after the cached blocks are computed."""
    a = chat(llm, "Describe the image.", [image("wide.png")])[1:]
    b = chat(llm, "Describe the image.", [image("big.png")])[1:]
    separate = [engine_run(llava_dir, [r], n_batch=2048, max_num_seqs=1)[0][0] for r in (a, b)]
    assert separate[0] != separate[1]
    cached, runner, engine = engine_run(llava_dir, [a, b, a], n_batch=2048, max_num_seqs=1, caching=True)
    assert cached == [separate[0], separate[1], separate[0]]
    # b shared only the blocks before its image with a; the second a took all its full blocks from the cache
    n = len(a[0])
    bs = runner.block_size
    first_image = a[1][0].offset
    assert runner.tokens_computed <= n + (n - first_image // bs * bs) + bs + 3 * 8


def test_int4_language_model_keeps_vision_in_full_precision(smollm2_hf, tmp_path):
    from quantserve.backends.torch.quant_linear import QuantLinear

    wider = build_tiny_llava(tmp_path / "llava-128", smollm2_hf, text_hidden=128)  # Marlin tiles: N % 64 == 0
    llm = load(wider, quant="int4")
    try:
        runner = llm._runner
        quantized = [n for n, m in runner.model.named_modules() if isinstance(m, QuantLinear)]
        assert quantized and all(n.startswith("model.layers.") for n in quantized)
        assert all(p.dtype == torch.float32 for p in runner.vision_model.parameters())
        img = image("wide.png")
        _, tokens, spans = chat(llm, "Describe the image.", [img])
        assert len(greedy(llm, tokens, spans, n=4)) == 4
    finally:
        llm.close()


def test_expand_images_places_each_image():
    img_a, img_b = image("tiny.gif"), image("wide.png")
    tokens, spans = expand_images([1, 9, 2, 9, 3], 9, [img_a, img_b], 3)
    assert tokens == [1, 9, 9, 9, 2, 9, 9, 9, 3]
    assert [(s.offset, s.length, s.image) for s in spans] == [(1, 3, img_a), (5, 3, img_b)]


def _gptq_llava(src, work):
    """A LLaVA whose language model is GPTQ (RTN-rounded, quantized by `quantserve convert` as a plain Llama),
    with the vision tower and projector kept dense: the layout GPTQ LLaVA checkpoints have."""
    import json
    import shutil

    from click.testing import CliRunner
    from safetensors.numpy import load_file, save_file

    from quantserve.cli import main

    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    text = work / "text"
    text.mkdir()
    (text / "config.json").write_text(
        json.dumps({**config["text_config"], "architectures": ["LlamaForCausalLM"]})
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, text / name)
    lm = {k.removeprefix("language_model."): v for k, v in tensors.items() if k.startswith("language_model.")}
    save_file(lm, str(text / "model.safetensors"))
    args = [
        "convert",
        "--src",
        str(text),
        "--dst",
        str(work / "text-gptq"),
        "--quant",
        "rtn",
        "--group-size",
        "64",
    ]
    assert CliRunner().invoke(main, args).exit_code == 0
    quantized = load_file(str(next((work / "text-gptq").glob("*.safetensors"))))
    out = work / "llava-gptq"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors"))
    merged = {f"language_model.{k}": v for k, v in quantized.items()}
    merged |= {k: v for k, v in tensors.items() if not k.startswith("language_model.")}
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    qconfig = json.loads((work / "text-gptq" / "config.json").read_text())["quantization_config"]
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    return out


def test_gptq_language_model_equals_its_dequantized_reference(smollm2_hf, tmp_path):
    """A GPTQ LLaVA on the torch backend (Marlin W4A16 language model, dense vision) against transformers on the
    exactly dequantized checkpoint."""
    from PIL import Image as PILImage
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from quantserve.quant.dequantize import dequantize_checkpoint

    src = build_tiny_llava(tmp_path / "llava-128", smollm2_hf, text_hidden=128)
    gptq = _gptq_llava(src, tmp_path)
    llm = load(gptq)
    try:
        assert llm.info.format == "gptq"
        img = image("wide.png")
        _, tokens, spans = chat(llm, "Describe the image.", [img])
        ours = prompt_logits(llm, tokens, spans)
    finally:
        llm.close()
    dense = dequantize_checkpoint(gptq, tmp_path / "dense", dtype="float32")
    model = LlavaForConditionalGeneration.from_pretrained(dense, dtype=torch.float32).eval()
    pixels = (
        AutoProcessor.from_pretrained(src)
        .image_processor(PILImage.open(io.BytesIO(img.data)), return_tensors="pt")
        .pixel_values
    )
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens]), pixel_values=pixels).logits[0, -1]
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-3


def test_images_count_toward_the_context(llava_dir):
    from quantserve.errors import ContextLengthExceededError
    from quantserve.llm import load as load_llm

    llm = load_llm(str(llava_dir), backend="torch", ctx_size=1024, max_num_seqs=1)
    try:
        one = chat(llm, "Describe the image.", [image("wide.png")])[1]
        assert llm.check_context(len(one), 16) == 16
        two = chat(llm, "Compare the images.", [image("wide.png"), image("tall.jpg")])[1]
        assert len(two) > 1024
        with pytest.raises(ContextLengthExceededError):
            llm.check_context(len(two), 16)
    finally:
        llm.close()
