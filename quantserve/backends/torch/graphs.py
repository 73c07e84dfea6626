"""CUDA graphs of the decode step: one per batch-size bucket, captured when the runner starts and replayed for every
step in which each sequence decodes one token (vLLM's cudagraph capture sizes).

A decode step launches a few hundred small kernels (per layer: norms, four or seven W4A16 GEMMs, rotary, the KV
write, paged attention, the MLP), and at batch 1 the launches, not the GPU, set the pace. A graph replays them all
in one launch. What a graph needs is what the paged kernel made possible: inputs of fixed shape at fixed
addresses. So the graphs own static buffers (token ids, positions, the cell each new K/V goes to, block tables
padded to the longest context, context lengths), sized for the largest bucket; a step copies its own rows in,
points the rows it does not use at a scratch block that no sequence owns, and replays the graph of the smallest
bucket that holds it. The rotary table is grown to the whole context first, so that a replay never reads a table
that a later growth would replace.

`capture=False` runs the same buffers through the eager forward instead of a graph: how the CPU tests check all
of this except the capture itself.
"""

from __future__ import annotations

import logging
import time

import torch

from quantserve.backends.torch.model import Transformer
from quantserve.backends.torch.step import DecodeBatch, StepBatch

log = logging.getLogger("quantserve.torch")


def capture_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets up to max_batch: 1, 2, 4, then multiples of 8 (vLLM's default list), the last one
    holding max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [-(-max_batch // 8) * 8 if max_batch > 4 else max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: Transformer,
        *,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        n_ctx: int,
        device: torch.device,
        capture: bool = True,
    ):
        """`scratch_block`: a cache block outside the ledger's range, written by the unused rows of a bucket."""
        self.model, self.block_size, self.n_ctx = model, block_size, n_ctx
        self.sizes = capture_sizes(max_batch)
        n = self.sizes[-1]
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.cell_index = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        for rotary in (
            model.rotary,
            model.rotary_local,
        ):  # whole tables now: a replay must never see one regrow
            if rotary is not None:
                rotary(self.positions[:1], n_ctx - 1)
        if capture:
            t0 = time.perf_counter()
            pool = None
            for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its memory pool
                pool = self._capture(size, pool)
            log.info(
                "CUDA graphs of the decode step captured for batch sizes %s in %.1fs",
                ",".join(map(str, self.sizes)),
                time.perf_counter() - t0,
            )

    def _forward(self, size: int) -> torch.Tensor:
        """Logits [size, V] fp32 of the first `size` rows of the static buffers."""
        rows = self.rows[:size]
        decode = DecodeBatch(rows, self.block_tables[:size], self.context_lens[:size], self.block_size)
        step = StepBatch(
            self.input_ids[:size], self.positions[:size], self.cell_index[:size], decode, None, rows, []
        )
        hidden = self.model(step.input_ids, step.positions, step, max_position=self.n_ctx - 1)
        return self.model.compute_logits(hidden)

    def _capture(self, size: int, pool) -> object:
        with torch.inference_mode():
            # warm-up outside the capture (Triton compiles, cuBLAS picks its kernels), on a side stream as
            # torch.cuda.graphs asks; every row writes its K/V into the scratch block
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
        self.graphs[size] = graph
        return graph.pool()

    def fits(self, step: StepBatch, n_plan: int) -> bool:
        """Whether this step is one the graphs replay: every planned sequence decodes one token and is sampled."""
        return (
            step.prefill is None
            and step.decode is not None
            and step.image_rows is None
            and len(step.sampled) == n_plan
            and n_plan <= self.sizes[-1]
        )

    def run(self, step: StepBatch) -> torch.Tensor:
        """Logits [B, V] fp32 of a step that `fits`: its rows copied into the buffers, the bucket's graph replayed.
        The result is the graph's own output buffer, valid until the next run."""
        d = step.decode
        assert d is not None
        b, width = d.block_tables.shape
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(step.input_ids)
        self.positions[:b].copy_(step.positions)
        self.cell_index[:b].copy_(step.cell_index)
        self.block_tables[:b, :width].copy_(d.block_tables)  # columns past width: stale, never read
        self.context_lens[:b].copy_(d.context_lens)
        if size > b:  # rows a previous, larger step used: back to the scratch block
            self.cell_index[b:size].fill_(self.scratch_block * self.block_size)
            self.block_tables[b:size].fill_(self.scratch_block)
            self.context_lens[b:size].fill_(1)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.logits[size][:b]
        with torch.inference_mode():
            return self._forward(size)[:b]
