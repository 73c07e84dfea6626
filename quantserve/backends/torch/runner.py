"""TorchRunner: the torch model, its paged KV cache and sampler behind the engine's ModelRunner protocol."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from quantserve.backends.torch.deltanet import RecurrentState
from quantserve.backends.torch.gpt_oss import OssMoe
from quantserve.backends.torch.graphs import DecodeGraphs
from quantserve.backends.torch.model import KVCache, Transformer
from quantserve.backends.torch.moe import SparseMoe
from quantserve.backends.torch.sampler import Sampler, check_params
from quantserve.backends.torch.step import prepare_step
from quantserve.core.model_size import Shape, torch_kv
from quantserve.core.plan import KVPlan
from quantserve.core.runner import DropKV, KVSpec, RunnerBase, VisionSpec
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import SampledToken, Sequence
from quantserve.core.settings import EngineSettings
from quantserve.errors import ConfigError
from quantserve.kernels import paged_attention
from quantserve.structured import Vocabulary

if TYPE_CHECKING:
    from quantserve.backends.torch.vision import LlavaVision
    from quantserve.vision.preprocess import ImageProcessorConfig

log = logging.getLogger("quantserve.torch")


def kv_bytes_per_token(model: Transformer, dtype: torch.dtype) -> int:
    """Over the attention layers only: Qwen3.5's DeltaNet layers keep a state per sequence instead."""
    a = model.args
    n_attn = sum(not x.linear for x in model.model.layers)
    return 2 * n_attn * a.num_key_value_heads * a.head_dim * torch.empty((), dtype=dtype).element_size()


def state_bytes_per_seq(model: Transformer, dtype: torch.dtype) -> int:
    """One sequence's recurrent state over every DeltaNet layer (0 for a model without them)."""
    from quantserve.backends.torch.deltanet import state_bytes

    size = torch.empty((), dtype=dtype).element_size()
    return sum(
        state_bytes(x.linear_attn.conv_dim, x.linear_attn.kernel, x.linear_attn.n_v, x.linear_attn.d_k,
                    x.linear_attn.d_v, size)
        for x in model.model.layers
        if x.linear
    )  # fmt: skip


def fill_gpu_blocks(model: Transformer, settings: EngineSettings, n_ctx: int, dtype: torch.dtype) -> int:
    """KV blocks that fit in the GPU's free memory (vLLM's gpu_memory_utilization), measured now that the
    weights are loaded: what a plan with `kv.cells` None asks for."""
    own = settings.torch
    per_block = kv_bytes_per_token(model, dtype) * own.block_size
    torch.cuda.empty_cache()  # memory freed while loading is still reserved by torch's allocator
    free, total = torch.cuda.mem_get_info()
    budget = free - (1 - own.gpu_memory_utilization) * total - 512 * 2**20  # activations
    budget -= settings.max_num_seqs * state_bytes_per_seq(model, dtype)  # the DeltaNets' state slots, if any
    blocks = int(budget // per_block) - 1  # the runner adds a scratch block
    if blocks < -(-n_ctx // own.block_size):
        raise ConfigError(
            f"only {max(budget, 0) / 2**30:.1f} GiB of GPU memory is left for the KV cache, less than one "
            f"{n_ctx}-token sequence needs; lower --ctx-size or use a smaller model",
            param="kv_size",
        )
    return blocks


class TorchRunner(RunnerBase):
    """Not thread-safe: the engine thread is its only caller. The engine's ledger decides which cache blocks each
    sequence uses (`seq.block_table`); the runner holds the cache's memory and writes and reads where they say."""

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        settings: EngineSettings,
        device: torch.device,
        vision: LlavaVision | None = None,
        image_config: ImageProcessorConfig | None = None,
        kv: KVPlan | None = None,
    ):
        """`kv`: the plan's cache (ModelPlan.kv); by default, what the model's config and `settings` give."""
        self.model = model
        self.vision_model, self.image_config = vision, image_config
        self.vision = (
            VisionSpec(vision.args.image_token_index, vision.args.tokens_per_image)
            if vision is not None
            else None
        )
        # image digest -> its embeddings [tokens_per_image, D]: a prompt is often prefilled in several chunks, and
        # the same image may come again (a follow-up turn); least recently used out
        self._image_features: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.max_cached_images = 2 * settings.max_num_seqs
        self.images_encoded = 0  # in all (tests)
        self.tokenizer = tokenizer
        self.settings = settings
        self.device = device
        self.n_vocab = model.args.vocab_size
        dtype = model.model.embed_tokens.weight.dtype
        if kv is None:
            a = model.args
            n_attn = sum(not x.linear for x in model.model.layers)  # DeltaNet layers keep no KV
            shape = Shape(a.num_hidden_layers, a.num_key_value_heads * n_attn, a.head_dim,
                          a.max_position_embeddings)  # fmt: skip
            fill = device.type == "cuda" and settings.torch.kv_fill_gpu
            kv = torch_kv(shape, settings, elem_bytes=dtype.itemsize, fill_gpu=fill)
        self.n_ctx = kv.n_ctx
        self.block_size = settings.torch.block_size
        if kv.cells is None:
            num_blocks = fill_gpu_blocks(model, settings, self.n_ctx, dtype)
        else:
            num_blocks = kv.cells // self.block_size
        if model.tp is not None:  # every rank's cache must hold the blocks rank 0's ledger hands out
            num_blocks = model.tp.agree_min(num_blocks)
        self.n_kv_cells = num_blocks * self.block_size
        # Qwen3.5: a recurrent state per running sequence in each DeltaNet layer, one slot per sequence the engine
        # runs at once; such a state cannot be cut at a block, so prefix caching is off (engine/kv/paged.py)
        self.state_slots = settings.max_num_seqs if any(x.linear for x in model.model.layers) else 0
        self.kv_spec = KVSpec("paged", cells=self.n_kv_cells, block_size=self.block_size,
                              prefix_cache=not self.state_slots, state_slots=self.state_slots)  # fmt: skip
        if self.n_kv_cells < self.n_ctx:
            raise ConfigError(
                f"the KV cache holds {self.n_kv_cells} tokens, fewer than one {self.n_ctx}-token sequence "
                "needs; raise --kv-size or lower --ctx-size",
                param="kv_size",
            )
        # Decode attention reads block tables in the Triton kernel on CUDA; on the CPU it gathers cells. The norms,
        # rotary + KV write and silu * up run as Triton kernels wherever Triton runs.
        triton = paged_attention.can_run(device)[0]
        model.use_fused_kernels(
            triton
        )  # the norms, rotary + KV write and silu * up: windows change none of them
        self.paged_kernel = triton  # windows and soft caps included (each layer passes its own)
        a = model.args
        # One block more than the ledger hands out: the scratch block that unused CUDA-graph rows write to.
        for layer in model.model.layers:
            if layer.linear:
                layer.linear_attn.state = RecurrentState.empty(
                    self.state_slots, layer.linear_attn, dtype, device
                )
            else:
                layer.self_attn.cache = KVCache(
                    (num_blocks + 1) * self.block_size, a.num_key_value_heads, a.head_dim, dtype, device
                )
        if self.state_slots:
            per_seq = sum(x.linear_attn.state.bytes_per_slot for x in model.model.layers if x.linear)
            log.info(
                "recurrent state: %d slots of %.2f MiB (%d DeltaNet layers); prefix caching is off for this model "
                "(a recurrent state holds a whole prefix and is not kept per block)",
                self.state_slots, per_seq / 2**20, sum(x.linear for x in model.model.layers),
            )  # fmt: skip
        self.graphs: DecodeGraphs | None = None
        # a tensor-parallel rank other than 0 computes its share of the logits (for the gather) and samples nothing
        self.samples = model.tp is None or model.tp.rank == 0
        self.sampling = False
        if model.tp is not None and device.type == "cuda":
            log.info("tensor parallel: decode steps run eagerly (no CUDA graphs around the all-reduces yet)")
        elif device.type == "cuda" and self.paged_kernel and settings.torch.cuda_graphs:
            looped = any(
                isinstance(x.mlp, OssMoe)
                or (isinstance(x.mlp, SparseMoe) and x.mlp.grouped is None)
                or x.linear
                for x in model.model.layers
            )  # (DeltaNet layers run each sequence's state on its own)
            if looped or dict(a.rope_scaling).get("rope_type") == "longrope":
                # experts looped over route on the host (gpt-oss's grouped MXFP4 experts do not, but their graphs
                # have not been checked on a GPU yet); LongRoPE picks its table by the step's longest position
                log.info(
                    "this model's decode step runs without CUDA graphs (experts that are not all on the grouped "
                    "W4A16 kernel, gpt-oss's experts, DeltaNet layers, or LongRoPE)"
                )
            else:
                self.graphs = self.decode_graphs(capture=True)
        self.sampler = Sampler(device, self.n_vocab)
        self.tokens_computed = 0  # tokens fed through the model, in all (prefix-cache hits are not)
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB) on %s",
            num_blocks,
            self.block_size,
            self.n_kv_cells,
            self.n_kv_cells * kv_bytes_per_token(model, dtype) / 2**30,
            device,
        )

    def decode_graphs(self, capture: bool) -> DecodeGraphs:
        """CUDA graphs of the decode step for up to max_num_seqs sequences (capture=False: the same buffers,
        run eagerly; for tests)."""
        return DecodeGraphs(
            self.model,
            max_batch=self.settings.max_num_seqs,
            max_blocks=-(-self.n_ctx // self.block_size),
            block_size=self.block_size,
            scratch_block=self.n_kv_cells // self.block_size,
            n_ctx=self.n_ctx,
            device=self.device,
            capture=capture,
        )

    # ---- tokens -----------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        return self.tokenizer.token_bytes(token, special=special)

    def vocabulary(self) -> Vocabulary:
        """The vocabulary as the grammar engine reads it (quantserve.structured)."""
        tok = self.tokenizer
        return Vocabulary(
            pieces=[tok.token_bytes(t, special=True) for t in range(tok.n_vocab)],
            control=tok.control,
            eog=tuple(sorted(tok.eog)),
            tokenize=lambda text: tok.tokenize(text, add_special=False, parse_special=False),
        )

    def is_eog(self, token: int) -> bool:
        return self.tokenizer.is_eog(token)

    @property
    def bos_token(self) -> int:
        return self.tokenizer.bos_token_id

    def adds_bos(self) -> bool:
        return self.tokenizer.add_bos

    def check_params(self, params: SamplingParams) -> None:
        check_params(params, self.n_vocab)

    # ---- execution --------------------------------------------------------------------------------

    def execute(self, plan: list[tuple[Sequence, int]]) -> list[SampledToken | None]:
        step = prepare_step(plan, self.block_size, self.device, self.paged_kernel)
        if step.image_pieces:
            step.image_embeds = self._image_embeds(plan, step.image_pieces)
        top = max(seq.num_computed + n for seq, n in plan) - 1  # the largest position: no device lookup
        with torch.inference_mode():
            sampled: list[SampledToken] = []
            if self.graphs is not None and self.graphs.fits(step, len(plan)):
                logits = self.graphs.run(step)  # [B, V] fp32, every sequence sampled
                sampled = self.sampler.sample(logits, [seq for seq, _ in plan])
            else:
                hidden = self.model(step.input_ids, step.positions, step, max_position=top)  # [T, D]
                if step.sampled:
                    logits = self.model.compute_logits(hidden[step.logits_index])  # [S, V] fp32
                    if not self.samples:
                        return [None] * len(plan)
                    # past the last collective (tensor parallel): a failure here is this step's own
                    self.sampling = True
                    try:
                        sampled = self.sampler.sample(logits, [plan[k][0] for k in step.sampled])
                    finally:
                        self.sampling = False
        results: list[SampledToken | None] = [None] * len(plan)
        for k, tok in zip(step.sampled, sampled, strict=True):
            results[k] = tok
        self.tokens_computed += len(step.positions)
        return results

    def _image_embeds(
        self, plan: list[tuple[Sequence, int]], pieces: tuple[tuple[int, int, int, int], ...]
    ) -> torch.Tensor:
        """The embeddings of the image pieces of this step, in order, encoding (in one batch) the images that are
        not cached yet."""
        from quantserve.vision.preprocess import pixel_values

        assert self.vision_model is not None and self.image_config is not None, "images sent to a text model"
        images = [plan[k][0].images[i].image for k, i, _, _ in pieces]
        cache = self._image_features
        new = list({img.digest: img for img in images if img.digest not in cache}.values())
        if new:
            pixels = torch.stack([torch.from_numpy(pixel_values(img, self.image_config)) for img in new])
            with torch.inference_mode():
                feats = self.vision_model(pixels.to(self.device))  # [N, tokens_per_image, D]
            for img, f in zip(new, feats, strict=True):
                cache[img.digest] = f
            self.images_encoded += len(new)
        for img in images:
            cache.move_to_end(img.digest)
        out = torch.cat(
            [cache[img.digest][lo:hi] for img, (_, _, lo, hi) in zip(images, pieces, strict=True)]
        )
        while len(cache) > self.max_cached_images:
            cache.popitem(last=False)
        return out

    def embed(self, tokens: list[int]) -> list[float]:
        """Mean-pooled, L2-normalised final hidden states (after the last norm) of one input, as llama.cpp's
        mean pooling gives. A forward of its own without the KV cache: it reads the weights only, so it may run
        on its own thread beside the engine's."""
        with torch.inference_mode():
            hidden = self.model(torch.tensor([tokens], device=self.device))[0].double().mean(0)
            vec = hidden / (hidden.norm() or 1.0)
        return vec.cpu().tolist()

    def score(self, tokens: list[int], first: int) -> np.ndarray:
        """Log-probabilities [len(tokens) - first - 1, vocab] of each position's next token from `first` on (the
        output layer runs for those only): one causal forward of its own, without the KV cache."""
        with torch.inference_mode():
            hidden = self.model(torch.tensor([tokens], device=self.device))[0, first : len(tokens) - 1]
            logp = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)  # fp32
        return logp.cpu().numpy()

    @property
    def gpu_share(self) -> float:
        return 0.0 if self.device.type == "cpu" else 1.0

    @property
    def scored_by(self) -> str:
        dtype = self.model.model.embed_tokens.weight.dtype
        return f"torch ({self.device.type}, {str(dtype).removeprefix('torch.')})"

    def release(self, seq: Sequence, *, keep_sampler: bool = False) -> None:
        if not keep_sampler:
            self.sampler.remove(seq)

    def drop_kv(self, ops: list[DropKV]) -> None:
        """Nothing to drop: a paged block's old contents are overwritten when it is used again."""

    def num_kv_used(self) -> None:
        return None  # the engine's ledger is the only count

    def close(self) -> None:
        self._image_features.clear()
        self.vision_model = None
        for layer in self.model.model.layers:
            if layer.linear:
                layer.linear_attn.state = None
            else:
                layer.self_attn.cache = None
        self.model = None
