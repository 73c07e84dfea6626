"""A LLaVA as transformers 5 saves it (LlavaProcessor.save_pretrained: the image processor nested in
processor_config.json, no preprocessor_config.json; a 224 px tower; no padding, a centre crop), with a llama or a
qwen2 language model, on both backends against transformers on the same weights: preprocessing bit for bit, greedy
tokens on square and non-square images, odd images served, and a processor that disagrees with its tower refused
at load with both sizes named."""

from __future__ import annotations

import asyncio
import io
import json
import shutil

import numpy as np
import pytest
import torch

from quantserve.chat import ChatRequest
from quantserve.core.multimodal import Image
from quantserve.errors import ModelFileError
from quantserve.formats.image_processor import ImageProcessorConfig
from quantserve.llm import LLM, load
from quantserve.vision.preprocess import pixel_values
from tests.conftest import THREADS
from tests.fixtures.vision import build_tf5_llava, sample_images

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tf5(request, smollm2_hf, tmp_path_factory):
    return build_tf5_llava(
        tmp_path_factory.mktemp(f"tf5-{request.param}") / "llava", smollm2_hf, text=request.param
    )


def image(data: bytes) -> Image:
    from PIL import Image as PILImage

    return Image(data, np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB")))


def png(w: int, h: int, seed: int = 3) -> bytes:
    from PIL import Image as PILImage

    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def greedy(llm: LLM, img: Image, n: int = 10) -> tuple[list[int], list[int]]:
    parts = [{"type": "image"}, {"type": "text", "text": "Describe the image."}]
    tokens, spans = llm.prepare_chat(ChatRequest([{"role": "user", "content": parts}]), [img])[1:]

    async def go():
        params = llm.sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [t async for out in llm.generate(tokens, params, images=spans) for t in out.token_ids]

    return tokens, asyncio.run(go())


def transformers_check(hf, img: Image, tokens: list[int], ours: list[int]) -> None:
    """Teacher-forced on our tokens, transformers picks the same ones, up to the first near tie."""
    from PIL import Image as PILImage

    model = transformers.LlavaForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(hf)
    pixels = processor.image_processor(PILImage.open(io.BytesIO(img.data)), return_tensors="pt").pixel_values
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens + ours]), pixel_values=pixels).logits[
            0, len(tokens) - 1 : -1
        ]
    ref = logits.argmax(-1).tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), len(ours))
    if same < len(ours):
        top2 = logits[same].topk(2).values
        gap = float(top2[0] - top2[1]) / float(logits[same].abs().max())
        # a parting only where transformers' own two best logits are all but tied (this random tiny model has
        # such ties, and the in-situ mmproj is f16, llama.cpp's own choice, so its image embeddings are a rounding
        # away from transformers' fp32 ones); a wrong crop or prompt parts where the choice is clear
        assert gap < 1e-2, f"first {same} tokens equal, then a gap of {gap:.2e} of the logit scale"


@pytest.mark.parametrize("name", ["300x180.png", "tall.jpg", "square.webp"])
def test_preprocessing_is_transformers_bit_for_bit(tf5, name):
    from PIL import Image as PILImage

    data = sample_images()[name]
    cfg = ImageProcessorConfig.from_dir(tf5)
    assert cfg.image_mean == (0.5, 0.5, 0.5) and cfg.crop_size == (224, 224) and not cfg.do_pad
    assert cfg.source.endswith("processor_config.json (image_processor)")
    ref = transformers.AutoProcessor.from_pretrained(tf5).image_processor(PILImage.open(io.BytesIO(data)))
    np.testing.assert_array_equal(pixel_values(image(data), cfg), ref["pixel_values"][0])


@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
def test_both_backends_give_transformers_tokens(tf5, backend, tmp_path):
    """The llama.cpp route converts in situ (text GGUF, mmproj, the processor settings beside them) and crops as
    the checkpoint does before libmtmd: a 300x180 image gives transformers' tokens there too."""
    llm = load(
        str(tf5), backend=backend, ctx_size=1024, max_num_seqs=1, threads=THREADS, cache_dir=str(tmp_path)
    )
    try:
        assert llm.info.backend == backend and llm.vision is not None and llm.vision.tokens_per_image == 256
        answers = []
        for name in ("300x180.png", "square.webp"):
            img = image(sample_images()[name])
            tokens, ours = greedy(llm, img)
            transformers_check(tf5, img, tokens, ours)
            answers.append(ours)
        assert answers[0] != answers[1]  # the image is read
        for w, h in ((1, 1), (1, 400), (400, 1), (13, 29)):  # odd images: served, never a shape error
            assert len(greedy(llm, image(png(w, h)), n=2)[1]) == 2
    finally:
        llm.close()


def test_a_processor_that_disagrees_with_its_tower_is_refused_at_load(tf5, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tf5, bad)
    cfg = json.loads((bad / "processor_config.json").read_text())
    cfg["image_processor"]["crop_size"] = {"height": 336, "width": 336}
    cfg["image_processor"]["size"] = {"shortest_edge": 336}
    (bad / "processor_config.json").write_text(json.dumps(cfg))
    want = (
        r"makes 336x336 images \(577 positions\), but the vision tower takes 224x224 images \(257 positions"
    )
    with pytest.raises(ModelFileError, match=want):
        load(str(bad), backend="torch", ctx_size=512)
    with pytest.raises(ModelFileError, match=want):  # the mmproj is not written for it either
        load(str(bad), backend="llamacpp", ctx_size=512, cache_dir=str(tmp_path / "cache"))
    cfg["image_processor"]["do_center_crop"] = False
    (bad / "processor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="keeping each image's aspect ratio with no centre crop"):
        load(str(bad), backend="torch", ctx_size=512)
