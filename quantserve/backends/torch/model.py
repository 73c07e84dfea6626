"""A compact Llama-family transformer (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, phi3, gemma2, gemma3,
gpt_oss, qwen3_5) in plain PyTorch, in the spirit of gpt-fast. A qwen3_moe or mixtral layer's MLP is a mixture of
experts (moe.py), a gpt_oss one its own (gpt_oss.py), and gpt-oss's attention has sinks. Qwen3.5's linear layers
are Gated DeltaNets (deltanet.py), with a recurrent state per sequence instead of KV.
Gemma's differences (ModelArgs says which apply): norms around attention and the MLP, GeGLU, a scaled embedding,
query_pre_attn_scalar, tanh caps on the logits, windowed layers with their own rope base.

Module and parameter names are the HF checkpoint's (`model.layers.3.self_attn.q_proj.weight`), so a state dict loads
verbatim. Two ways to run it:
- `forward(input_ids [B, T])`: causal attention over whole sequences, no cache (tests, calibration);
- `forward(input_ids [T], positions [T], step)`: a flattened batch of many sequences' new tokens against a paged KV
  cache (the engine); `step` (backends/torch/step.py) says where each sequence's tokens are and where their K/V go.
The model keeps one rotary table; a forward looks its positions up once and hands every layer the same cos/sin.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.backends.torch.args import ModelArgs
from quantserve.backends.torch.attend import attend, window_mask
from quantserve.backends.torch.deltanet import GatedDeltaNet
from quantserve.backends.torch.gpt_oss import OssMoe
from quantserve.backends.torch.moe import SparseMoe
from quantserve.backends.torch.rope import Rope, RotaryEmbedding, apply_rope
from quantserve.backends.torch.step import DecodeBatch, StepBatch
from quantserve.backends.torch.tp_shard import TensorParallel
from quantserve.kernels import fused
from quantserve.kernels.paged_attention import paged_decode_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.triton_ops = (
            False  # one Triton kernel (kernels/fused.py) instead of PyTorch's ops: set by use_fused_kernels
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise in fp32 like transformers' LlamaRMSNorm, then scale in the model dtype. With `residual`:
        the norm of x + residual, returned with that sum (the next residual), as vLLM's fused_add_rms_norm."""
        if self.triton_ops:
            return fused.rms_norm(x, self.weight, self.eps, residual)
        return fused.rms_norm_ref(x, self.weight, self.eps, residual)


class KVCache:
    """One layer's paged cache: [num_blocks * block_size, n_kv_heads, head_dim] for K and for V."""

    def __init__(self, num_cells: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros(num_cells, n_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_cells, n_kv, head_dim, dtype=dtype, device=device)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        d, bias = args.hidden_size, args.attention_bias
        self.gated = args.attn_output_gate  # Qwen3.5: q_proj gives each head's query, then its output gate
        q_size = self.n_heads * self.head_dim * (2 if self.gated else 1)
        sizes = (q_size, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
        if not args.fused:
            self.q_proj = nn.Linear(d, sizes[0], bias=bias)
            self.k_proj = nn.Linear(d, sizes[1], bias=bias)
            self.v_proj = nn.Linear(d, sizes[2], bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=args.attn_out_bias)
        # gpt-oss: each head's learned logit for attending to nothing (fp32, like the scores it joins)
        self.sinks = nn.Parameter(torch.empty(self.n_heads), requires_grad=False) if args.attn_sinks else None
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        # q|k|v in one: as the checkpoint has it (phi3), or fused after loading (backends/torch/fuse.py)
        self.qkv_proj: nn.Module | None = nn.Linear(d, sum(sizes), bias=bias) if args.fused else None
        self.qkv_sizes = sizes
        self.scale = (args.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.partial_rotary = bool(args.rotary_dim)  # the Triton rotary kernel turns whole heads only
        self.softcap = args.attn_softcap
        self.window = args.layer_windows[layer_idx] if args.layer_windows else 0
        self.cache: KVCache | None = None  # set by the runner for paged serving
        self.triton_ops = (
            False  # rotary embedding and KV write in one Triton kernel: set by use_fused_kernels
        )

    def forward(self, x: torch.Tensor, rope: Rope, step: StepBatch | None = None) -> torch.Tensor:
        """x [B, T, D] (whole sequences, causal) or [T, D] with `step` (paged)."""
        lead = x.shape[:-1]
        if self.qkv_proj is not None:  # fused after loading (backends/torch/fuse.py)
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(*lead, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.contiguous(), gate.reshape(*lead, self.n_heads * self.head_dim)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        if step is None:  # [B, T, H, D] -> SDPA's [B, H, T, D]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            mask = window_mask(q.shape[1], self.window, q.device) if self.window else None
            out = attend(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                mask,
                self.scale,
                self.softcap,
                self.sinks,
            ).transpose(1, 2)
        else:
            cache = self.cache
            assert cache is not None, "paged forward needs a KV cache"
            if self.triton_ops and not self.head_dim & (self.head_dim - 1) and not self.partial_rotary:
                q = fused.rope_and_cache(q, k, v, cos, sin, step.cell_index, cache.k, cache.v)
            else:
                q = fused.rope_and_cache_ref(q, k, v, cos, sin, step.cell_index, cache.k, cache.v)
            out = self._paged(q, step)
        out = out.reshape(*lead, self.n_heads * self.head_dim)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _decode_kernel(self, q: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
        """The paged Triton kernel over the decoding sequences' block tables (this layer's window and cap)."""
        cache = self.cache
        assert cache is not None
        return paged_decode_attention(
            q, cache.k, cache.v, d.block_tables, d.context_lens, d.block_size, self.scale,
            window=self.window, softcap=self.softcap, sinks=self.sinks,
        )  # fmt: skip

    def _paged(self, q: torch.Tensor, step: StepBatch) -> torch.Tensor:
        """q [T, H, D] (the new K/V already in their cells): attend over each sequence's context, one call for
        the decoding sequences, one for the prefilling ones (all indices prepared once per step)."""
        cache = self.cache
        assert cache is not None
        d = step.decode
        if d is not None and d.kv_cells is None and step.prefill is None:  # all tokens decode, in order
            return self._decode_kernel(q, d)
        out = torch.empty_like(q)
        if d is not None and d.kv_cells is None:
            out[d.q_index] = self._decode_kernel(q[d.q_index], d)
        elif d is not None:
            keys = cache.k[d.kv_cells].transpose(1, 2)  # [B, KV, C, D]
            vals = cache.v[d.kv_cells].transpose(1, 2)
            mask = d.window_mask(self.window) if self.window else d.mask
            o = attend(
                q[d.q_index][:, :, None, :], keys, vals, mask, self.scale, self.softcap, self.sinks
            )  # [B, H, 1, D]
            out[d.q_index] = o[:, :, 0, :]
        if (p := step.prefill) is not None:
            keys = cache.k[p.kv_cells].transpose(1, 2)  # [P, KV, C, D]
            vals = cache.v[p.kv_cells].transpose(1, 2)
            mask = p.window_mask(self.window) if self.window else p.mask
            o = attend(
                q[p.q_index].transpose(1, 2), keys, vals, mask, self.scale, self.softcap, self.sinks
            )  # [P, H, Q, D]
            out[p.q_index[p.q_valid]] = o.transpose(1, 2)[p.q_valid]
        return out


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, ff = args.hidden_size, args.intermediate_size
        if not args.fused:
            self.gate_proj = nn.Linear(d, ff, bias=False)
            self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        # gate|up in one (gate first): as the checkpoint has it (phi3), or fused after loading
        self.gate_up_proj: nn.Module | None = nn.Linear(d, 2 * ff, bias=False) if args.fused else None
        self.triton_ops = False  # silu(gate) * up in one Triton kernel: set by use_fused_kernels
        self.gelu = args.hidden_act == "gelu_tanh"  # GeGLU (Gemma): gelu(gate, tanh approximation) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if self.gelu:
                gate, up = gate_up.chunk(2, dim=-1)
                return self.down_proj(F.gelu(gate, approximate="tanh") * up)
            return self.down_proj(fused.silu_mul(gate_up) if self.triton_ops else fused.silu_mul_ref(gate_up))
        gate = self.gate_proj(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = bool(args.layer_types) and args.layer_types[layer_idx] == "linear_attention"
        if self.linear:  # Qwen3.5's Gated DeltaNet in place of attention
            self.linear_attn = GatedDeltaNet(args.hidden_size, *args.deltanet, eps=args.rms_norm_eps)
        else:
            self.self_attn = Attention(args, layer_idx)
        self.mlp: nn.Module = MLP(args)
        if args.swiglu:  # gpt-oss
            self.mlp = OssMoe(args.num_experts, args.num_experts_per_tok, args.hidden_size,
                              args.moe_intermediate_size, *args.swiglu, packed=args.packed_experts)  # fmt: skip
        elif args.num_experts:
            self.mlp = SparseMoe(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                 args.num_experts_per_tok, args.norm_topk_prob, args.shared_expert_size)  # fmt: skip
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.sandwich = args.sandwich_norms  # Gemma: a norm after attention, and before and after the MLP
        # set for tensor parallel: attention and MLP outputs are then partial sums (backends/torch/tp.py)
        self.tp: TensorParallel | None = None
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        step: StepBatch | None = None,
        residual: torch.Tensor | None = None,
        split: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] or [T, D] (with `step`); `rope` is the model's cos/sin for these tokens' positions.

        Returns the layer's output; with `split` (the model's own loop, vLLM's layout) as (this MLP's output, the
        residual stream before it), so that every add happens inside the next norm. `residual`: x is then the
        previous layer's split MLP output, not yet added to it."""
        if self.sandwich:  # each norm's output is added to the stream, not the stream normalised in place
            x = x if residual is None else x + residual
            x = x + self.post_attention_layernorm(self._sum(self.mix(self.input_layernorm(x), rope, step)))
            h = self.post_feedforward_layernorm(self._sum(self.mlp(self.pre_feedforward_layernorm(x))))
            return (h, x) if split else h + x
        if residual is None:
            h, res = self.input_layernorm(x), x
        else:
            h, res = self.input_layernorm(x, residual)
        h = self._sum(self.mix(h, rope, step))
        h, res = self.post_attention_layernorm(h, res)
        h = self._sum(self.mlp(h))
        return (h, res) if split else h + res

    def mix(self, h: torch.Tensor, rope: Rope, step: StepBatch | None) -> torch.Tensor:
        """The token mixer: attention, or a DeltaNet (which has no positions: it carries its state instead)."""
        return self.linear_attn(h, step) if self.linear else self.self_attn(h, rope, step)

    @property
    def window(self) -> int:
        return 0 if self.linear else self.self_attn.window

    def _sum(self, h: torch.Tensor) -> torch.Tensor:
        """Under tensor parallel each rank's row-parallel o_proj / down_proj gives a partial sum: add them up."""
        return h if self.tp is None else self.tp.all_reduce(h)


def empty_embedding(rows: int, dim: int, dtype: torch.dtype | None = None) -> nn.Embedding:
    """An nn.Embedding whose weight is left unset, for the checkpoint to fill: models are built on the meta device
    and then loaded, and nn.Embedding's own random init there goes through torch's Python references, which import
    torch._dynamo (1.4-1.8 s of every process's first load, a tensor-parallel rank's included)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim, dtype=dtype))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = empty_embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp: TensorParallel | None = None  # set for tensor parallel (backends/torch/tp.py)
        self.rotary = RotaryEmbedding(args)
        # gemma3: the windowed layers' own rope base, without the global layers' scaling
        self.rotary_local = (
            RotaryEmbedding(replace(args, rope_theta=args.rope_local_theta, rope_scaling=()))
            if args.rope_local_theta
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        step: StepBatch | None = None,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [B, T, D] for input_ids [B, T], or [T, D] with a paged step."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            max_position = input_ids.shape[-1] - 1
        rope = self.rotary(positions, max_position)  # once, for every layer
        local = self.rotary_local(positions, max_position) if self.rotary_local is not None else rope
        x = (
            self.model.embed_tokens(input_ids)
            if self.tp is None
            else self.tp.embed(self.model.embed_tokens, input_ids)
        )
        if self.args.embed_scale:  # Gemma: sqrt(hidden), rounded to the model's dtype as transformers does
            x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)
        # each image position takes its image's embedding instead of its token's
        if step is not None and step.image_embeds is not None:
            x[step.image_rows] = step.image_embeds.to(x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, local if layer.window else rope, step, residual, split=True)
        return self.model.norm(x, residual)[0]

    def use_fused_kernels(self, on: bool) -> None:
        """Run norms, rotary + KV write and silu * up as the Triton kernels of kernels/fused.py, and a DeltaNet's
        decoding step as kernels/deltanet.py's (CUDA, or the interpreter in tests), or as PyTorch ops: the same
        arithmetic either way."""
        for m in self.modules():
            if isinstance(m, RMSNorm | Attention | MLP | GatedDeltaNet):
                m.triton_ops = on

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.tp is not None:  # each rank has a slice of the vocabulary
            logits = self.tp.gather_vocab(logits, self.args.vocab_size)
        if cap := self.args.final_softcap:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits
