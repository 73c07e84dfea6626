"""Images on the llama.cpp backend: an mmproj GGUF through libmtmd (llama_cpp.mtmd_cpp) turns an image into
embeddings for the text model, which the runner decodes at the image's positions like tokens.

libmtmd does its own preprocessing (for LLaVA: pad to square, bicubic resize, CLIP normalisation, as clip.cpp writes
it). A checkpoint's own processor may instead resize the short side and centre-crop (transformers' LlavaImageProcessor
without do_pad, what LlavaProcessor saves by default): then a non-square image would differ from the first token on.
So when the checkpoint's image-processor settings sit beside the mmproj (`quantserve convert` and the in-situ cache
copy them there), the geometric steps run here, exactly as the torch backend runs them (vision/preprocess.py), and
libmtmd gets the final image_size x image_size crop, which its resize copies unchanged; only its normalisation is
left to it. Only projectors with a fixed number of tokens per image (LLaVA 1.5's MLP) are served: the prompt
reserves that many positions for each image before any is encoded.
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import llama_cpp as lc
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from quantserve.backends.llamacpp.library import init_mtmd_log
from quantserve.core.multimodal import Image
from quantserve.core.runner import KVCacheFull
from quantserve.core.sequence import Sequence
from quantserve.errors import ModelFileError
from quantserve.formats import read_gguf_info
from quantserve.formats.hf_config import image_processor_settings
from quantserve.formats.image_processor import ImageProcessorConfig, check_tower
from quantserve.vision.preprocess import geometry

log = logging.getLogger("quantserve.llamacpp")

CHUNK_IMAGE = 1  # MTMD_INPUT_CHUNK_TYPE_IMAGE


class MtmdVision:
    """One mtmd context for a loaded text model. Not thread-safe: the engine thread is its only caller."""

    def __init__(self, mmproj: Path, model, *, n_threads: int, use_gpu: bool):
        self.prepare = checkpoint_geometry(mmproj)  # before anything is loaded: a mismatch is refused first
        init_mtmd_log()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads
        self.marker = mtmd.mtmd_default_marker()
        self.ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), model, params)
        if not self.ctx:
            raise ModelFileError(
                f"libmtmd could not load the projector {mmproj}; is it an mmproj GGUF made for this text model "
                "(`quantserve convert` writes both)? Run with --log-level debug to see llama.cpp's reason"
            )
        if not mtmd.mtmd_support_vision(self.ctx):
            self.close()
            raise ModelFileError(f"{mmproj} has no vision encoder (an audio projector?); images need one")
        self.n_embd = lc.llama_model_n_embd(model)
        probe = Image(b"probe", np.zeros((336, 336, 3), dtype=np.uint8))
        self.tokens_per_image = len(self.encode(probe))
        log.info("vision: %s, %d tokens per image", mmproj.name, self.tokens_per_image)

    def encode(self, image: Image) -> np.ndarray:
        """The image's embeddings [tokens, n_embd] float32, for the text model's input."""
        rgb = image.rgb if self.prepare is None else self.prepare(image.rgb)
        h, w, _ = rgb.shape
        pixels = np.ascontiguousarray(rgb, dtype=np.uint8)
        bitmap = mtmd.mtmd_bitmap_init(w, h, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            text = mtmd.mtmd_input_text(self.marker, len(self.marker), False, True)
            bitmaps = (ctypes.c_void_p * 1)(bitmap)
            rc = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if rc != 0:
                raise RuntimeError(f"mtmd_tokenize failed with code {rc}")
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) != CHUNK_IMAGE:
                    continue
                n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                rc = mtmd.mtmd_encode_chunk(self.ctx, chunk)
                if rc != 0:
                    raise RuntimeError(f"mtmd_encode_chunk failed with code {rc}")
                out = mtmd.mtmd_get_output_embd(self.ctx)
                return np.ctypeslib.as_array(out, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
            raise RuntimeError("libmtmd made no image chunk of the image")
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def close(self) -> None:
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None


def checkpoint_geometry(mmproj: Path) -> Callable[[np.ndarray], np.ndarray] | None:
    """The checkpoint's pad / resize / crop (RGB uint8 -> its crop), from the image-processor settings beside
    the mmproj, found as transformers finds them; None where there are none (libmtmd's own preprocessing).

    Raises:
        ModelFileError: settings whose images the projector's tower cannot take (both sizes named).
    """
    found = image_processor_settings(mmproj.parent)
    if found is None:
        return None
    cfg = ImageProcessorConfig.from_dict(found[0], source=found[1])
    meta = read_gguf_info(mmproj).metadata
    tower = {
        "image_size": meta.get("clip.vision.image_size"),
        "patch_size": meta.get("clip.vision.patch_size"),
    }
    check_tower(cfg, {k: v for k, v in tower.items() if v is not None})
    log.info("vision: images cropped as %s says, then handed to libmtmd", found[1])
    return partial(geometry, cfg=cfg)


class ImageDecoder:
    """Decodes a sequence's prompt chunk that holds image positions, in order: each run of text tokens as a token
    batch, each run of an image's positions as a batch of its embeddings (a llama_batch holds one or the other,
    and an image's later tokens must see the KV of what came before it, so the runs cannot share a batch). An
    image is encoded once, however many steps its positions take (least recently used out)."""

    def __init__(self, vision: MtmdVision, n_embd: int, cache_size: int):
        self.vision = vision
        self.tokens_per_image = vision.tokens_per_image
        self.embd_batch = lc.llama_batch_init(self.tokens_per_image, n_embd, 1)
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()  # digest -> [tokens, n_embd]
        self.images_encoded = 0

    def decode(self, ctx, batch, seq: Sequence, n: int) -> int:
        """Decode seq's next n positions into its slot; returns the row of the last decode's last position (whose
        logits are kept when it is the prompt's last token).

        Raises:
            KVCacheFull: llama.cpp found no room (the engine preempts).
        """
        start, stop, slot = seq.num_computed, seq.num_computed + n, seq.block_table[0]
        pos, last_row = start, -1
        for span in [s for s in seq.images if s.offset < stop and s.end > start] + [None]:
            text_end = min(span.offset, stop) if span is not None else stop
            if pos < text_end:  # the text before this image (or after the last)
                for j, p in enumerate(range(pos, text_end)):
                    batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = seq.tokens[p], p, 1, 0
                    batch.seq_id[j][0] = slot
                batch.n_tokens = text_end - pos
                batch.logits[batch.n_tokens - 1] = int(text_end == len(seq.tokens))
                _decode(ctx, batch)
                last_row, pos = batch.n_tokens - 1, text_end
            if span is not None:
                lo, hi = max(span.offset, pos), min(span.end, stop)
                embd = self._embeddings(span.image)[lo - span.offset : hi - span.offset]
                self._decode_embeddings(ctx, embd, lo, slot, logits_last=hi == len(seq.tokens))
                last_row, pos = hi - lo - 1, hi
        return last_row

    def _embeddings(self, image: Image) -> np.ndarray:
        cache = self._cache
        if image.digest not in cache:
            cache[image.digest] = self.vision.encode(image)
            self.images_encoded += 1
            while len(cache) > self.cache_size:
                cache.popitem(last=False)
        cache.move_to_end(image.digest)
        return cache[image.digest]

    def _decode_embeddings(self, ctx, embd: np.ndarray, first_pos: int, slot: int, logits_last: bool) -> None:
        """Rows of image embeddings into `slot` at positions first_pos, first_pos + 1, …"""
        b, n = self.embd_batch, len(embd)
        rows = np.ascontiguousarray(embd, dtype=np.float32)
        ctypes.memmove(b.embd, rows.ctypes.data, rows.nbytes)
        for i in range(n):
            b.pos[i], b.n_seq_id[i], b.logits[i] = first_pos + i, 1, 0
            b.seq_id[i][0] = slot
        b.logits[n - 1] = int(logits_last)
        b.n_tokens = n
        _decode(ctx, b)

    def close(self) -> None:
        self._cache.clear()
        self.vision.close()
        lc.llama_batch_free(self.embd_batch)


def _decode(ctx, batch) -> None:
    rc = lc.llama_decode(ctx, batch)
    if rc != 0:
        raise KVCacheFull() if rc == 1 else RuntimeError(f"llama_decode failed with code {rc}")
