"""LlamaCppRunner: one llama.cpp model and one multi-sequence context; executes scheduled batches.

One class over llama.cpp's C API (model, context, batch, per-sequence samplers, an embedding context): it owns
native memory, so its whole lifetime stays in one file.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import llama_cpp as lc
import numpy as np

from quantserve.backends.llamacpp.library import init_backend
from quantserve.backends.llamacpp.offload import gpu_device, plan_offload
from quantserve.backends.llamacpp.rpc import add_workers
from quantserve.backends.llamacpp.sampler import SamplerChain
from quantserve.backends.llamacpp.vision import ImageDecoder, MtmdVision
from quantserve.core.model_size import gguf_shape, llamacpp_kv
from quantserve.core.plan import KVPlan
from quantserve.core.rpc import parse_endpoints
from quantserve.core.runner import CopyKV, DropKV, KVCacheFull, KVSpec, RunnerBase, VisionSpec
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import SampledToken, Sequence, TokenLogprob
from quantserve.core.settings import EngineSettings, cpu_threads, parse_tensor_split
from quantserve.errors import ConfigError, ModelFileError
from quantserve.formats import read_gguf_info
from quantserve.structured import Vocabulary

log = logging.getLogger("quantserve.llamacpp")

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
IMAGE_MARKER = "<image>"  # what LLaVA's chat templates write for an image: one token of its vocabulary
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}  # enum llama_split_mode
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


class LlamaCppRunner(RunnerBase):
    """Owns the llama_model, the llama_context (n_seq_max = max_num_seqs, unified KV) and one llama_batch.

    Not thread-safe: the engine thread is its only caller (embeddings use a context of their own)."""

    def __init__(
        self,
        path: Path,
        settings: EngineSettings,
        kv: KVPlan | None = None,
        *,
        mmproj: Path | None = None,
        rank_outputs: int = 0,
    ):
        """`kv`: the plan's cache (ModelPlan.kv); by default, what the GGUF's header and `settings` give."""
        init_backend()
        self.path = Path(path)
        self.settings = settings
        own = settings.llamacpp
        for name, value in (("cache_type_k", own.cache_type_k), ("cache_type_v", own.cache_type_v)):
            if value not in KV_CACHE_TYPES:
                raise ConfigError(f"{name} {value!r} is not one of {', '.join(KV_CACHE_TYPES)}", param=name)
        if own.rpc:
            add_workers(
                parse_endpoints(own.rpc)
            )  # before the device list is read: their devices count as GPUs
        self.offload = plan_offload(self.path, settings, gpu_device(own))
        # a CPU-only build choosing 0 is no news (debug); anything else is worth a line at startup
        log.log(
            logging.DEBUG if self.offload.device is None and own.n_gpu_layers is None else logging.INFO,
            "GPU offload: %s",
            self.offload.describe(),
        )
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = self.offload.n_gpu_layers
        mparams.use_mmap = own.use_mmap
        mparams.split_mode = SPLIT_MODES[own.split_mode]
        mparams.main_gpu = own.main_gpu
        if own.tensor_split:
            shares = parse_tensor_split(own.tensor_split)
            # llama.cpp reads llama_max_devices() floats; the array lives as long as the model's params
            self._tensor_split = (ctypes.c_float * lc.llama_max_devices())(*shares)
            mparams.tensor_split = self._tensor_split
        self.model = lc.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise ModelFileError(
                f"llama.cpp could not load {self.path}; the file passed validation, so its architecture or "
                "hyper-parameters are probably not supported by this llama.cpp build (run with --log-level debug "
                "to see llama.cpp's reason)"
            )
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        if kv is None:
            info = read_gguf_info(self.path)
            kv = llamacpp_kv(
                gguf_shape(info.metadata), settings, n_ctx_cap=info.context_length if rank_outputs else None
            )
        # A reranker's context stops at its learned positions (core/model_size.llamacpp_kv), where a longer input
        # would make llama.cpp abort. Per-sequence KV (llama.cpp "streams") keeps every sequence's cells
        # contiguous and its own, so a greedy request gives the same tokens alone or batched (measured: identical;
        # with the unified pool, summation order over interleaved cells makes tokens drift after a few dozen).
        # It costs n_ctx cells per sequence.
        self.n_ctx = kv.n_ctx
        n_cells = kv.cells
        threads = cpu_threads(settings.threads) or max(1, (os.cpu_count() or 2))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_cells
        cparams.n_batch = settings.n_batch
        cparams.n_ubatch = settings.n_batch
        cparams.n_seq_max = settings.max_num_seqs
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = own.kv_unified
        # a windowed model's windowed layers keep only their window (plus a ubatch) unless swa_full, as llama-server
        cparams.swa_full = own.swa_full
        cparams.type_k = KV_CACHE_TYPES[own.cache_type_k]
        cparams.type_v = KV_CACHE_TYPES[own.cache_type_v]
        cparams.no_perf = True
        # With per-sequence KV, flash attention on or off gives batched tokens identical to unbatched ones
        # (measured); with the unified pool both drift. So llama.cpp's own choice (auto) is kept by default.
        if own.flash_attn not in FLASH_ATTN:
            raise ConfigError(
                f"flash_attn {own.flash_attn!r} is not one of auto, on, off", param="flash_attn"
            )
        cparams.flash_attn_type = FLASH_ATTN[own.flash_attn]
        # A reranker (a classification head, see GGUFInfo.rank_outputs) only scores whole inputs: its context
        # pools each sequence through the head, and a batch must fit one ubatch (an encoder attends both ways).
        # llama.cpp keeps n_cls_out values per sequence (the labels' count, else 1): so many are read back.
        self.rank_outputs = lc.llama_model_n_cls_out(self.model) if rank_outputs else 0
        self.rank_labels = tuple(
            (lc.llama_model_cls_label(self.model, i) or b"").decode("utf-8", "replace")
            for i in range(self.rank_outputs)
        )
        if rank_outputs:
            cparams.embeddings = True
            cparams.pooling_type = lc.LLAMA_POOLING_TYPE_RANK
            cparams.n_batch = cparams.n_ubatch = max(settings.n_batch, self.n_ctx)
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise ConfigError(
                f"llama.cpp could not create a context with {n_cells} KV cells and {settings.max_num_seqs} "
                "sequences; lower --ctx-size, --kv-size or --max-num-seqs"
            )
        self.n_kv_cells = lc.llama_n_ctx(self.ctx)
        # Sequences run in slots (llama.cpp seq ids). Per-sequence KV streams compute each run of consecutive slots
        # as its own pass over the weights (see execute), so the ledger keeps running slots packed; the unified
        # pool batches any set of sequences in one pass.
        self.kv_spec = KVSpec(
            "slots",
            cells=self.n_kv_cells,
            num_slots=settings.max_num_seqs,
            shared=own.kv_unified,
            pack_slots=not own.kv_unified,
            # a recurrent state cannot be cut back to a shorter prefix (llama_memory_seq_rm refuses), so such a
            # model keeps no prefix cache, and nothing is copied between its slots
            prefix_cache=not (
                lc.llama_model_is_recurrent(self.model) or lc.llama_model_is_hybrid(self.model)
            ),
            window=0 if own.swa_full else lc.llama_model_n_swa(self.model),
        )
        if self.kv_spec.window:
            log.info(
                "sliding-window layers keep the last %d positions of each sequence (--swa-full keeps all): a "
                "cached prefix is reused by a prompt that continues all of it",
                self.kv_spec.window,
            )
        log.info(
            "KV cache: %d cells (%s), %s, flash attention %s",
            self.n_kv_cells,
            "one pool shared by all sequences"
            if own.kv_unified
            else f"{settings.max_num_seqs} sequences x {self.n_ctx}",
            f"K {own.cache_type_k} / V {own.cache_type_v}",
            own.flash_attn,
        )
        self.n_threads = threads
        self.memory = lc.llama_get_memory(self.ctx)  # NULL for an encoder, which keeps no KV cache
        self.batch = lc.llama_batch_init(cparams.n_batch, 0, 1)
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._special_pieces: list[bytes | None] = [None] * self.n_vocab
        self._eog = {t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)}
        self._samplers: dict[int, SamplerChain] = {}  # Sequence.seq_id -> chain
        self._embed_ctx = None
        self.vision: VisionSpec | None = None
        self._images: ImageDecoder | None = None
        if mmproj is not None:
            self._load_vision(mmproj, self.offload.n_gpu_layers != 0)

    @property
    def gpu_share(self) -> float:
        o = self.offload
        return 0.0 if o.device is None else min(1.0, o.n_gpu_layers / max(1, o.n_layer))

    def _load_vision(self, mmproj: Path, use_gpu: bool) -> None:
        marker = self.tokenize(IMAGE_MARKER, add_special=False, parse_special=True)
        if len(marker) != 1:
            self.close()
            raise ModelFileError(
                f"the text model {self.path.name} has no {IMAGE_MARKER} token, which its chat template writes "
                "for an image; convert the LLaVA checkpoint with `quantserve convert`, which keeps it"
            )
        try:
            self._images = ImageDecoder(
                MtmdVision(mmproj, self.model, n_threads=self.n_threads, use_gpu=use_gpu),
                lc.llama_model_n_embd(self.model),
                cache_size=2 * self.settings.max_num_seqs,
            )
        except BaseException:
            self.close()
            raise
        self.vision = VisionSpec(marker[0], self._images.tokens_per_image)

    # ---- vocabulary ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return buf[:n]

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token prints; control tokens print nothing unless `special` (then their text)."""
        table = self._special_pieces if special else self._pieces
        piece = table[token]
        if piece is None:
            piece = self._piece(token, special=special)
            table[token] = piece
        return piece

    def vocabulary(self) -> Vocabulary:
        """The vocabulary as the grammar engine reads it (quantserve.structured)."""
        control = frozenset(
            t
            for t in range(self.n_vocab)
            if lc.llama_vocab_get_attr(self.vocab, t) & lc.LLAMA_TOKEN_ATTR_CONTROL
        )
        return Vocabulary(
            pieces=[self.token_bytes(t, special=True) for t in range(self.n_vocab)],
            control=control,
            eog=tuple(sorted(self._eog)),
            tokenize=lambda text: self.tokenize(text, add_special=False, parse_special=False),
        )

    def special_text(self, token: int) -> str:
        """A token's text including control tokens (for chat templates' bos_token/eos_token)."""
        return self._piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def _piece(self, token: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    @property
    def bos_token(self) -> int:
        return lc.llama_vocab_bos(self.vocab)

    @property
    def eos_token(self) -> int:
        return lc.llama_vocab_eos(self.vocab)

    def adds_bos(self) -> bool:
        return bool(lc.llama_vocab_get_add_bos(self.vocab))

    def pair_inputs(self, query: str, documents: list[str]) -> list[list[int]]:
        """A cross-encoder's input for the query with each document, as llama-server's format_prompt_rerank
        (tools/server/server-common.cpp) builds it: the GGUF's rerank template (tokenizer.chat_template.rerank)
        with {query} and {document} filled in where it has one (Qwen3-Reranker's); else BOS if the vocabulary adds
        one, the query, EOS (SEP where there is no EOS) if it adds one, SEP if it adds one, the document, and EOS
        again."""
        template = lc.llama_model_chat_template(self.model, b"rerank")
        if template:
            text = template.decode("utf-8").replace("{query}", query)
            return [
                self.tokenize(text.replace("{document}", d), add_special=False, parse_special=True)
                for d in documents
            ]
        bos, eos, sep = self.bos_token, self.eos_token, lc.llama_vocab_sep(self.vocab)
        eos = eos if eos >= 0 else sep
        add_eos = [eos] if lc.llama_vocab_get_add_eos(self.vocab) and eos >= 0 else []
        add_sep = [sep] if lc.llama_vocab_get_add_sep(self.vocab) and sep >= 0 else []
        head = [bos] * (self.adds_bos() and bos >= 0) + self.tokenize(
            query, add_special=False, parse_special=False
        )
        return [
            head + add_eos + add_sep + self.tokenize(d, add_special=False, parse_special=False) + add_eos
            for d in documents
        ]

    def check_params(self, params) -> None:
        """Build the sampler chain once, so a bad logit_bias is a 400 for this request, not an engine failure."""
        if params.logit_bias:
            SamplerChain(self.vocab, self.n_vocab, params).close()

    # ---- execution ----------------------------------------------------------------------------

    def execute(self, plan: list[tuple[Sequence, int]]) -> list[SampledToken | None]:
        results: list[SampledToken | None] = [None] * len(plan)
        text: list[int] = []
        for k, (seq, n) in enumerate(plan):
            if any(s.offset < seq.num_computed + n and s.end > seq.num_computed for s in seq.images):
                results[k] = self._execute_with_images(seq, n)
            else:
                text.append(k)
        if text:
            for k, r in zip(text, self._execute_tokens([plan[k] for k in text]), strict=True):
                results[k] = r
        return results

    def _execute_tokens(self, plan: list[tuple[Sequence, int]]) -> list[SampledToken | None]:
        b = self.batch
        i = 0
        out_idx = [-1] * len(plan)
        # Per-sequence KV: llama.cpp cuts a batch into one ubatch per run of consecutive, increasing seq ids, in
        # batch order, with the same number of tokens for each sequence (split_equal), and each ubatch is a full
        # pass over the weights. So the batch is written in seq id order: 8 decodes in one pass take 22 ms here,
        # in the scheduler's order 36 ms. A sequence's seq id is its slot, the one block of its block table.
        for k in sorted(range(len(plan)), key=lambda k: plan[k][0].block_table[0]):
            seq, n = plan[k]
            start = seq.num_computed
            toks = seq.tokens
            sid = seq.block_table[0]
            for j in range(n):
                b.token[i] = toks[start + j]
                b.pos[i] = start + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = sid
                b.logits[i] = 0
                i += 1
            if start + n == len(toks):
                b.logits[i - 1] = 1
                out_idx[k] = i - 1
        b.n_tokens = i
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise KVCacheFull() if rc == 1 else RuntimeError(f"llama_decode failed with code {rc}")
        results: list[SampledToken | None] = []
        for (seq, _), idx in zip(plan, out_idx, strict=True):
            if idx < 0:
                results.append(None)
                continue
            results.append(self._sample(seq, idx))
        return results

    def _sample(self, seq: Sequence, idx: int) -> SampledToken:
        """Sample seq's next token from the logits of batch row `idx` of the last decode."""
        chain = self._sampler(seq)
        logits = None
        if seq.params.logprobs or seq.guide is not None:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
        raw = logits.copy() if seq.params.logprobs and seq.guide is not None else logits
        if seq.guide is not None:
            # The grammar's mask goes straight into llama.cpp's logits, before the chain samples them.
            seq.guide.mask(logits)
        tok = chain.sample(self.ctx, idx)
        lp = self._logprob(raw, tok, seq.params) if seq.params.logprobs else None
        return SampledToken(tok, lp)

    def _execute_with_images(self, seq: Sequence, n: int) -> SampledToken | None:
        assert self._images is not None, "images sent to a text model"
        row = self._images.decode(self.ctx, self.batch, seq, n)
        return self._sample(seq, row) if seq.num_computed + n == len(seq.tokens) else None

    def score(self, tokens: list[int], first: int) -> np.ndarray:
        """Log-probabilities [len(tokens) - first - 1, vocab] of each position's next token from `first` on: the
        tokens decoded in one batch in slot 0 (emptied first), logits asked for those positions only (the output
        layer over the vocabulary is the costly part). For perplexity and KL (quantserve.evaluate); the engine must
        not run on this runner at the same time."""
        n, b = len(tokens), self.batch
        if n > self.settings.n_batch:
            raise ValueError(f"{n} tokens to score; the batch holds {self.settings.n_batch}")
        lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), 0, -1, -1)
        for j, t in enumerate(tokens):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, j, 1, int(j >= first)
            b.seq_id[j][0] = 0
        b.n_tokens = n
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed while scoring")
        # rows come back in batch order for the positions that asked for logits: first .. n-1
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(n - first, self.n_vocab))[:-1]
        y = logits - logits.max(axis=-1, keepdims=True)
        return y - np.log(np.exp(y).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)

    scored_by = "llama.cpp"

    def _sampler(self, seq: Sequence) -> SamplerChain:
        chain = self._samplers.get(seq.seq_id)
        if chain is None:
            chain = SamplerChain(self.vocab, self.n_vocab, seq.params)
            self._samplers[seq.seq_id] = chain
        return chain

    @staticmethod
    def _logprob(logits: np.ndarray, token: int, params: SamplingParams) -> TokenLogprob:
        """The model's own logprobs (before sampling filters and any grammar mask)."""
        m = float(logits.max())
        lse = m + float(np.log(np.exp(logits - m).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if (top_n := params.top_logprobs) > 0:
            cand = np.argpartition(-logits, top_n - 1)[:top_n]
            cand = cand[np.argsort(-logits[cand], kind="stable")]
            top = tuple((int(t), float(logits[t]) - lse) for t in cand)
        asked = tuple(float(logits[t]) - lse for t in params.logprob_tokens)
        return TokenLogprob(token, float(logits[token]) - lse, top, asked)

    def release(self, seq: Sequence, *, keep_sampler: bool = False) -> None:
        if not keep_sampler:
            chain = self._samplers.pop(seq.seq_id, None)
            if chain is not None:
                chain.close()

    def drop_kv(self, ops: list[DropKV | CopyKV]) -> None:
        """Make the cache agree with the ledger: drop KV, and copy a prefix between slots (per-sequence streams:
        llama.cpp copies the whole stream at the next decode, so the tail past the prefix is dropped after)."""
        for op in ops:
            if isinstance(op, CopyKV):
                lc.llama_memory_seq_cp(self.memory, op.src, op.dst, -1, -1)
                lc.llama_memory_seq_rm(self.memory, op.dst, op.n, -1)
            else:
                lc.llama_memory_seq_rm(self.memory, op.slot, op.start, -1)

    def num_kv_used(self) -> int:
        """Cells in use according to llama.cpp itself (for leak tests)."""
        total = 0
        for sid in range(self.settings.max_num_seqs):
            hi = lc.llama_memory_seq_pos_max(self.memory, sid)
            if hi >= 0:
                total += hi - lc.llama_memory_seq_pos_min(self.memory, sid) + 1
        return total

    # ---- reranking ----------------------------------------------------------------------------

    def rank(self, inputs: list[list[int]]) -> list[list[float]]:
        """The classification head's outputs for each input (a query and a document joined, see pair_inputs),
        several inputs per decode: up to max_num_seqs of them and n_batch tokens."""
        assert self.rank_outputs, "rank() on a model without a classification head"
        limit = lc.llama_n_batch(self.ctx)
        b = self.batch
        out: list[list[float]] = []
        i = 0
        while i < len(inputs):
            group: list[list[int]] = []
            n = 0
            while i < len(inputs) and len(group) < self.settings.max_num_seqs and n + len(inputs[i]) <= limit:
                group.append(inputs[i])
                n += len(inputs[i])
                i += 1
            if not group:
                raise ValueError(f"an input of {len(inputs[i])} tokens is over the batch of {limit}")
            if self.memory:
                lc.llama_memory_clear(self.memory, True)
            k = 0
            for sid, tokens in enumerate(group):
                for pos, t in enumerate(tokens):
                    b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = t, pos, 1, 1
                    b.seq_id[k][0] = sid
                    k += 1
            b.n_tokens = k
            rc = lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} while ranking")
            for sid in range(len(group)):
                row = lc.llama_get_embeddings_seq(self.ctx, sid)
                out.append([float(row[j]) for j in range(self.rank_outputs)])
        return out

    # ---- embeddings ---------------------------------------------------------------------------

    def embed(self, tokens: list[int]) -> list[float]:
        """Mean-pooled, L2-normalised embedding of one input, from a second context of its own."""
        if self._embed_ctx is None:
            cp = lc.llama_context_default_params()
            cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_ctx
            cp.n_seq_max = 1
            cp.embeddings = True
            cp.pooling_type = lc.LLAMA_POOLING_TYPE_MEAN
            cp.n_threads = cp.n_threads_batch = self.n_threads
            cp.no_perf = True
            self._embed_ctx = lc.llama_init_from_model(self.model, cp)
            if not self._embed_ctx:
                raise ConfigError("llama.cpp could not create an embeddings context for this model")
        ctx = self._embed_ctx
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        batch = lc.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = len(tokens)
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} while embedding")
            n_embd = lc.llama_model_n_embd(self.model)
            vec = np.ctypeslib.as_array(lc.llama_get_embeddings_seq(ctx, 0), shape=(n_embd,)).astype(
                np.float64
            )
        finally:
            lc.llama_batch_free(batch)
        norm = float(np.linalg.norm(vec)) or 1.0
        return (vec / norm).tolist()

    def close(self) -> None:
        for chain in self._samplers.values():
            chain.close()
        self._samplers.clear()
        if self._embed_ctx:
            lc.llama_free(self._embed_ctx)
            self._embed_ctx = None
        if getattr(self, "_images", None) is not None:
            self._images.close()
            self._images = None
        if self.ctx:
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None
