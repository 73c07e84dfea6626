"""One engine step laid out once for every layer: the flattened tokens and positions, where their K/V go, and the
gather indices and masks each attention call needs (nano-vllm's prepare_prefill/prepare_decode).

Everything is built on the host from the plan's Python lists and moved to the device once; the layers then only
index and call attention, with no host synchronisation and no Python loop over sequences. Decoding sequences (one
new token) attend together in one call, given as block tables and context lengths: the paged kernel
(kernels/paged_attention.py) reads those directly, and without it the cells to gather are derived from them on the
device once per step. Prefilling sequences (several new tokens, after any cached prefix) attend together in
another call, padded to the longest chunk and the longest context (a varlen batch as padded tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantserve.core.sequence import Sequence


@dataclass
class DecodeBatch:
    """Sequences with one new token: row i is token q_index[i] of the flat batch."""

    q_index: torch.Tensor  # int64 [B]
    block_tables: torch.Tensor  # int32 [B, W]: each row's cache blocks, padded with block 0
    context_lens: torch.Tensor  # int32 [B]: positions each row attends to, its new token included
    block_size: int
    # Without the paged kernel (CPU): the cache cells of each row's context, padded with cell 0, and which are real
    kv_cells: torch.Tensor | None = None  # int64 [B, W * block_size]
    mask: torch.Tensor | None = None  # bool [B, 1, 1, W * block_size]
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask for a layer that attends to the last `window` positions only (made once per step)."""
        if window not in self._windowed:
            assert self.mask is not None
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            keep = pos[None, :] >= (self.context_lens - window)[:, None]
            self._windowed[window] = self.mask & keep[:, None, None]
        return self._windowed[window]

    def gather_indices(self) -> None:
        """Fill kv_cells and mask from the block tables, on the device (for attention without the kernel)."""
        pos = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.block_tables.device)
        self.kv_cells = (
            self.block_tables.long()[:, pos // self.block_size] * self.block_size + pos % self.block_size
        )
        self.mask = (pos[None, :] < self.context_lens[:, None])[:, None, None]


@dataclass
class PrefillBatch:
    """Sequences with several new tokens, padded to Q queries and C context positions each."""

    q_index: torch.Tensor  # int64 [P, Q]: each sequence's tokens in the flat batch (padding: 0)
    q_valid: torch.Tensor  # bool [P, Q]
    kv_cells: torch.Tensor  # int64 [P, C]
    mask: (
        torch.Tensor
    )  # bool [P, 1, Q, C]: causal, after the cached prefix; padding queries see position 0 only
    q_pos: torch.Tensor | None = None  # int64 [P, Q]: each query's position (padding: 0)
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask for a layer that attends to the last `window` positions only (made once per step)."""
        if window not in self._windowed:
            assert self.q_pos is not None
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            keep = pos[None, None, :] > self.q_pos[:, :, None] - window
            self._windowed[window] = self.mask & keep[:, None]
        return self._windowed[window]


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    cell_index: torch.Tensor  # int64 [T]: the cache cell each new token's K/V is written to
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    logits_index: torch.Tensor  # int64 [S]: the tokens whose logits are sampled
    sampled: list[int]  # which planned sequences those are, in the plan
    # Image positions among the new tokens: image_rows[r] takes the embedding image_embeds[r] instead of its
    # token's. Each piece (plan index, image index in seq.images, first, stop) is a run of one image's embeddings;
    # the runner encodes the images and sets image_embeds.
    image_rows: torch.Tensor | None = None  # int64 [R]
    image_pieces: tuple[tuple[int, int, int, int], ...] = ()
    image_embeds: torch.Tensor | None = None  # [R, D]
    # linear-attention layers (Qwen3.5): each sequence's run of new tokens (first index, count, its state slot,
    # whether it starts from position 0, so from a zero state)
    recurrent: tuple[tuple[int, int, int, bool], ...] = ()
    # the one-token segments among them (decoding sequences), on the device once per step: their rows, their slots
    single_rows: torch.Tensor | None = None
    single_slots: torch.Tensor | None = None


def _cells(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """Cache cells of positions [start, stop) of a sequence with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def prepare_step(
    plan: list[tuple[Sequence, int]], block_size: int, device: torch.device, paged_kernel: bool = False
) -> StepBatch:
    """The step's batch: for each planned (sequence, n), its next n tokens after num_computed. `paged_kernel`:
    decode attention runs kernels/paged_attention.py, which reads block tables (else cells are gathered)."""
    ids: list[int] = []
    positions: list[int] = []
    cell_index: list[int] = []
    decode_rows: list[tuple[int, int, list[int]]] = []  # (token index, context, its blocks)
    prefill_rows: list[tuple[int, int, int, list[int]]] = []  # (first token index, n, context, context cells)
    logits_index: list[int] = []
    sampled: list[int] = []
    image_rows: list[int] = []
    image_pieces: list[tuple[int, int, int, int]] = []
    recurrent: list[tuple[int, int, int, bool]] = []
    for k, (seq, n) in enumerate(plan):
        start, ctx = seq.num_computed, seq.num_computed + n
        first = len(ids)
        if seq.state_slot >= 0:
            recurrent.append((first, n, seq.state_slot, start == 0))
        ids.extend(seq.tokens[start:ctx])
        positions.extend(range(start, ctx))
        cell_index.extend(_cells(seq.block_table, start, ctx, block_size))
        if n == 1:
            decode_rows.append((first, ctx, seq.block_table[: -(-ctx // block_size)]))
        else:
            prefill_rows.append((first, n, ctx, _cells(seq.block_table, 0, ctx, block_size)))
        for i, span in enumerate(seq.images):
            lo, hi = max(span.offset, start), min(span.end, ctx)
            if lo < hi:
                image_rows.extend(range(first + lo - start, first + hi - start))
                image_pieces.append((k, i, lo - span.offset, hi - span.offset))
        if ctx == len(seq.tokens):  # its whole prompt is in: its next token is sampled
            logits_index.append(len(ids) - 1)
            sampled.append(k)

    def tensor(values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    decode = None
    if decode_rows:
        width = max(len(t) for _, _, t in decode_rows)
        decode = DecodeBatch(
            q_index=tensor([i for i, _, _ in decode_rows]),
            block_tables=tensor([t + [0] * (width - len(t)) for _, _, t in decode_rows], torch.int32),
            context_lens=tensor([ctx for _, ctx, _ in decode_rows], torch.int32),
            block_size=block_size,
        )
        if not paged_kernel:
            decode.gather_indices()
    prefill = None
    if prefill_rows:
        q_width = max(n for _, n, _, _ in prefill_rows)
        c_width = max(ctx for _, _, ctx, _ in prefill_rows)
        q_pos = torch.arange(q_width)
        c_pos = torch.arange(c_width)
        masks = []
        for _, n, ctx, _ in prefill_rows:
            # query j sits at position ctx - n + j and sees every position up to its own
            m = c_pos[None, :] <= (ctx - n + q_pos)[:, None]
            m[n:] = False
            m[n:, 0] = True  # padding queries attend to one position, so their (unused) rows stay finite
            masks.append(m)
        prefill = PrefillBatch(
            q_index=tensor([[i + j if j < n else 0 for j in range(q_width)] for i, n, _, _ in prefill_rows]),
            q_valid=tensor([[j < n for j in range(q_width)] for _, n, _, _ in prefill_rows], torch.bool),
            kv_cells=tensor([c + [0] * (c_width - len(c)) for _, _, _, c in prefill_rows]),
            mask=torch.stack(masks)[:, None].to(device, non_blocking=True),
            q_pos=tensor(
                [[ctx - n + j if j < n else 0 for j in range(q_width)] for _, n, ctx, _ in prefill_rows]
            ),
        )
    return StepBatch(
        input_ids=tensor(ids),
        positions=tensor(positions),
        cell_index=tensor(cell_index),
        decode=decode,
        prefill=prefill,
        logits_index=tensor(logits_index),
        sampled=sampled,
        image_rows=tensor(image_rows) if image_rows else None,
        image_pieces=tuple(image_pieces),
        recurrent=tuple(recurrent),
        single_rows=tensor([f for f, n, _, _ in recurrent if n == 1]) if recurrent else None,
        single_slots=tensor([sl for _, n, sl, _ in recurrent if n == 1]) if recurrent else None,
    )
