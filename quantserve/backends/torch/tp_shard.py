"""Tensor parallel for the torch model: which slice of each weight a rank holds, and the collectives that join them
(the gpt-fast / vLLM / Megatron layout).

- Column parallel (each rank computes some outputs): q/k/v by heads, gate/up by rows of the MLP, and the same in
  every expert of a mixture (and Qwen3.5-MoE's shared expert). Fused ones (Phi-3's qkv_proj and gate_up_proj)
  split each part apart.
- A Gated DeltaNet (Qwen3.5) splits by heads: each rank keeps its share of the key heads and of the value heads
  (those that read them), so in_proj_qkv and the conv split their q, k and v parts apart; in_proj_z, in_proj_a,
  in_proj_b, A_log and dt_bias by value heads; each rank keeps its heads' recurrent state. Its gated norm (one
  weight per head dimension) is replicated, and its out_proj is row parallel.
- gpt-oss: the attention sinks go with their heads; the stacked experts split within each expert as the others,
  gate|up by rows of the MLP (gate and up interleaved, so a contiguous share keeps each pair together) and down
  along its input, on whole 32-value MXFP4 blocks (the blocks and their scales cut, never decoded). The shares
  may differ by a block: the released models' 2880 rows are 90 blocks, which 4 or 8 ranks take as 23/23/22/22 or
  12/.../11 (`expert_blocks`). Each expert's down bias is added once, by rank 0.
- Row parallel (each rank reads some inputs, and the outputs are partial sums): o_proj, down_proj and a DeltaNet's
  out_proj. One all-reduce after the token mixer and one after the MLP joins them (TransformerBlock._sum).
- Vocab parallel: each rank holds ceil(V / N) rows of the embedding and the output layer (the last padded). A
  token's embedding comes from the rank that holds its row (the others add zeros); the logits are gathered.
- Everything else (norms, the MoE router, q/k norms) is replicated.

A rank builds the model from ModelArgs with its share of the heads and MLP rows (`local_args`), so each module has
its slice's shape, and the loader hands it the slice of each checkpoint tensor (`Shards`). A quantized weight is
cut in its canonical unpacked form (kernels/qweight.py) before the Marlin repack: along N anywhere, along K only on
whole groups (the scales and zeros go with their rows). Act-order checkpoints (g_idx) are refused for the row
parallel layers, whose input rows they permute across the whole K; the column parallel ones keep their g_idx.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.errors import ConfigError

COLUMN = (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj", ".linear_attn.in_proj_z",
          ".linear_attn.in_proj_a", ".linear_attn.in_proj_b")  # fmt: skip
FUSED = (".qkv_proj", ".gate_up_proj", ".linear_attn.in_proj_qkv", ".linear_attn.conv1d")
ROW = (".o_proj", ".down_proj", ".linear_attn.out_proj")
HEADS = (".linear_attn.A_log", ".linear_attn.dt_bias", ".self_attn.sinks")  # one value per (value) head
# gpt-oss's stacked experts (backends/torch/gpt_oss.py) by parameter: the dimension that splits, and how
OSS_EXPERTS = {
    "gate_up_proj_blocks": (1, "column"), "gate_up_proj_scales": (1, "column"), "gate_up_proj_bias": (1, "column"),
    "gate_up_proj": (2, "column"), "down_proj_blocks": (2, "row"), "down_proj_scales": (2, "row"),
    "down_proj": (1, "row"), "down_proj_bias": (0, "once"),
}  # fmt: skip
VOCAB = ("model.embed_tokens", "lm_head")


@dataclass
class TensorParallel:
    """This rank's place, and the collectives over the ranks' group (None: torch.distributed's default group)."""

    rank: int
    world: int
    group: Any = None
    orders: Any = None  # the gloo group rank 0's orders travel on (backends/torch/tp.py)

    def agree_min(self, n: int) -> int:
        """The smallest of every rank's n (a KV cache each rank sized from its own free memory)."""
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.orders)
        return int(t)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding from the rank holding its row; the others give zeros, and the sum is exact."""
        rows = emb.weight.shape[0]
        local = ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), emb.weight)
        return self.all_reduce(x.masked_fill(outside[..., None], 0))

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab]


def expert_blocks(ff: int, rank: int, world: int) -> tuple[int, int]:
    """gpt-oss: the first 32-row block of the experts' width `ff` that `rank` holds, and how many (whole blocks,
    the first ff / 32 % world ranks one more)."""
    base, extra = divmod(ff // 32, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def local_args(args, world: int, rank: int = 0):
    """The ModelArgs of one rank's slice: its share of the attention and KV heads and of the MLP rows (gpt-oss's
    experts: this rank's whole blocks, `expert_blocks`).

    Raises:
        ConfigError: a dimension that does not split evenly over `world` ranks, named.
    """
    checks = {
        "attention heads (num_attention_heads)": args.num_attention_heads,
        "KV heads (num_key_value_heads)": args.num_key_value_heads,
    }
    if args.swiglu:  # gpt-oss: whole 32-row blocks, shares differing by one at most
        if args.moe_intermediate_size // 32 < world:
            raise ConfigError(
                f"--tensor-parallel-size {world}: the experts' {args.moe_intermediate_size} rows are fewer than "
                f"{world} blocks of 32; use at most {args.moe_intermediate_size // 32} ranks",
                param="tensor_parallel_size",
            )
    elif args.num_experts:
        checks["expert MLP rows (moe_intermediate_size)"] = args.moe_intermediate_size
    else:
        checks["MLP rows (intermediate_size)"] = args.intermediate_size
    if args.shared_expert_size:
        checks["shared expert MLP rows (shared_expert_intermediate_size)"] = args.shared_expert_size
    deltanet = args.deltanet
    if deltanet:
        checks["DeltaNet key heads (linear_num_key_heads)"] = deltanet[0]
        checks["DeltaNet value heads (linear_num_value_heads)"] = deltanet[1]
        deltanet = (deltanet[0] // world, deltanet[1] // world, *deltanet[2:])
    for what, n in checks.items():
        if n % world:
            raise ConfigError(
                f"--tensor-parallel-size {world}: the model's {n} {what} do not split evenly over {world} ranks; "
                f"use a size that divides {n}",
                param="tensor_parallel_size",
            )
    return replace(
        args,
        num_attention_heads=args.num_attention_heads // world,
        num_key_value_heads=args.num_key_value_heads // world,
        intermediate_size=args.intermediate_size // world if not args.num_experts else args.intermediate_size,
        moe_intermediate_size=(
            32 * expert_blocks(args.moe_intermediate_size, rank, world)[1]
            if args.swiglu
            else args.moe_intermediate_size // world
        ),
        shared_expert_size=args.shared_expert_size // world,
        deltanet=deltanet,
    )


class Shards:
    """The slice of each checkpoint tensor that one rank holds, by the tensor's name in the model."""

    def __init__(self, args, rank: int, world: int):
        self.args, self.rank, self.world = args, rank, world  # args: the whole model's

    def _parts(self, prefix: str, n: int) -> list[int]:
        """The sizes of a column-parallel linear's outputs that split apart (one, or a fused linear's parts)."""
        a = self.args
        if prefix.endswith(".qkv_proj"):
            return [a.num_attention_heads * a.head_dim, *2 * [a.num_key_value_heads * a.head_dim]]
        if prefix.endswith(".gate_up_proj"):
            return [n // 2, n // 2]
        if prefix.endswith((".linear_attn.in_proj_qkv", ".linear_attn.conv1d")):  # q, k, v side by side
            n_k, n_v, d_k, d_v, _ = a.deltanet
            return [n_k * d_k, n_k * d_k, n_v * d_v]
        return [n]

    def columns(self, prefix: str, n: int) -> torch.Tensor:
        """The output rows (of n) this rank computes, as indices."""
        return torch.cat([torch.arange(a, b) for a, b in self._ranges(prefix, n)])

    def kind(self, prefix: str) -> str:
        if prefix.endswith(COLUMN + FUSED):
            return "column"
        if prefix.endswith(ROW):
            return "row"
        if prefix in VOCAB:
            return "vocab"
        return "replicated"

    def dense(self, name: str, t) -> torch.Tensor:
        """This rank's slice of the dense tensor `name` (a parameter: `....q_proj.weight`). `t` is the tensor, or
        a safetensors slice of it (`safe_open(...).get_slice(name)`), of which only this rank's rows or columns
        are then read."""
        prefix, _, leaf = name.rpartition(".")
        kind = "column" if name.endswith(HEADS) else self.kind(prefix)
        shape = tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)
        if self.args.swiglu and prefix.endswith(".mlp.experts") and leaf in OSS_EXPERTS:
            dim, how = OSS_EXPERTS[leaf]
            if how == "once":
                return t[...] if self.rank == 0 else torch.zeros(shape, dtype=t[...].dtype)
            first, n = expert_blocks(self.args.moe_intermediate_size, self.rank, self.world)
            per_block = shape[dim] // (
                self.args.moe_intermediate_size // 32
            )  # 64 gate|up rows, 32 rows, or 1 block
            cut = (slice(None),) * dim + (slice(first * per_block, (first + n) * per_block),)
            return t[cut]
        if kind == "column":
            share = [(a, b) for a, b in self._ranges(prefix, shape[0])]
            return torch.cat([t[a:b] for a, b in share])
        if kind == "row" and leaf == "weight":
            step = shape[1] // self.world
            return t[:, self.rank * step : (self.rank + 1) * step]
        if kind == "row":  # a row-parallel bias is added once, after the sum
            return t[...] if self.rank == 0 else torch.zeros(shape, dtype=t[...].dtype)
        if kind == "vocab":
            rows = -(-shape[0] // self.world)
            part = t[self.rank * rows : min((self.rank + 1) * rows, shape[0])]
            return F.pad(part, (0, 0, 0, rows - part.shape[0])) if part.shape[0] < rows else part
        return t[...]

    def _ranges(self, prefix: str, n: int) -> list[tuple[int, int]]:
        """The output rows (of n) this rank computes, as ranges: its share of each part."""
        out, offset = [], 0
        for size in self._parts(prefix, n):
            share = size // self.world
            out.append((offset + self.rank * share, offset + (self.rank + 1) * share))
            offset += size
        return out

    def vocab_rows(self, vocab: int) -> int:
        return -(-vocab // self.world)

    def quantized(self, prefix: str, qw):
        """This rank's slice of a quantized linear, in the canonical form (kernels/qweight.QuantizedWeight).

        Raises:
            ConfigError: a row-parallel layer whose K does not split on whole groups, or act-order there.
        """
        kind = self.kind(prefix)
        if kind == "column":
            idx = self.columns(prefix, qw.N)
            return replace(
                qw,
                qweight=qw.qweight[:, idx],
                scales=qw.scales[:, idx],
                zeros=None if qw.zeros is None else qw.zeros[:, idx],
            )
        if kind != "row":
            return qw
        share = qw.K // self.world
        k0, k1 = self.rank * share, (self.rank + 1) * share
        if qw.act_order and not torch.equal(qw.g_idx, torch.arange(qw.K, device=qw.g_idx.device) // qw.group):
            raise ConfigError(
                f"{prefix}: an act-order (desc_act) checkpoint permutes this row-parallel layer's input rows across "
                f"all of K, which tensor parallel cannot split; serve it with --tensor-parallel-size 1, or "
                "requantize without act-order",
                param="tensor_parallel_size",
            )
        if qw.group_size == -1:  # one group spanning K: every slice keeps the same scales
            return replace(qw, qweight=qw.qweight[k0:k1], g_idx=None)
        if share % qw.group_size:
            raise ConfigError(
                f"{prefix}: its K = {qw.K} input features split over {self.world} ranks are {share} each, not a "
                f"multiple of its group size {qw.group_size}: a rank would hold part of a group. Use a "
                f"--tensor-parallel-size that keeps whole groups, or a checkpoint with a smaller group size",
                param="tensor_parallel_size",
            )
        g0, g1 = k0 // qw.group_size, k1 // qw.group_size
        return replace(
            qw,
            qweight=qw.qweight[k0:k1],
            scales=qw.scales[g0:g1],
            zeros=None if qw.zeros is None else qw.zeros[g0:g1],
            g_idx=None,
        )
