"""A compact Llama-family transformer (llama, mistral, qwen2, qwen3) in plain PyTorch, in the spirit of gpt-fast.

Module and parameter names are the HF checkpoint's (`model.layers.3.self_attn.q_proj.weight`), so a state dict loads
verbatim. Two ways to run it:
- `forward(input_ids [B, T])`: causal attention over whole sequences, no cache (tests, calibration);
- `forward(input_ids [T], positions [T], batch)`: a flattened batch of many sequences' new tokens against a paged KV
  cache (the engine); `batch` says where each sequence's tokens are and where their K/V go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.errors import UnsupportedFormatError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2: q/k/v carry a bias
    qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: tuple[tuple[str, Any], ...] = field(default=())  # sorted items of HF's rope_scaling dict

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Raises UnsupportedFormatError for architectures this model does not implement."""
        names = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedFormatError(
                f"architecture {names or cfg.get('model_type')!r} is not supported by the torch backend "
                f"(supported: {', '.join(ARCHITECTURES)}); use --backend llamacpp with a GGUF"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise UnsupportedFormatError(
                f"rope scaling {rope_type!r} is not supported by the torch backend (supported: linear, llama3, "
                "yarn); use --backend llamacpp"
            )
        scaling = () if rope_type == "default" else tuple(sorted({**rope, "rope_type": rope_type}.items()))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            # Llama/Qwen2 default to untied; a missing lm_head is caught when loading weights.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
        )


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the attention scaling of cos/sin, as transformers'
    `ROPE_INIT_FUNCTIONS` compute them for default, linear, llama3 and yarn."""
    dim, base = args.head_dim, args.rope_theta
    # fp32 like transformers, so that both models see the same frequencies.
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    s = dict(args.rope_scaling)
    kind = s.get("rope_type", "default")
    if kind == "linear":
        return (inv_freq / s["factor"]).float(), 1.0
    if kind == "llama3":
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    if kind == "yarn":
        old_ctx = s.get("original_max_position_embeddings") or args.max_position_embeddings
        factor = s.get("factor") or args.max_position_embeddings / old_ctx

        def mscale(scale: float, m: float = 1.0) -> float:
            return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

        attention_factor = s.get("attention_factor")
        if attention_factor is None:
            if s.get("mscale") and s.get("mscale_all_dim"):
                attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
            else:
                attention_factor = mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(s.get("beta_fast", 32)), correction_dim(s.get("beta_slow", 1))
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        return inv.float(), float(attention_factor)
    return inv_freq.float(), 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in fp32 (HF's rotate_half layout: halves, not pairs)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin [T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like transformers' LlamaRMSNorm, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class PagedBatch:
    """Where a flattened batch's tokens belong. Sequence i owns tokens [q_start[i], q_start[i] + q_len[i]) of the
    batch and has context_lens[i] tokens in the cache after this step (its new ones included)."""

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each token's K/V
    q_start: list[int]
    q_len: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with 0
    block_size: int
    decode_rows: torch.Tensor | None = None  # int64 [num_decode]: sequences with q_len 1, batched together
    prefill_rows: list[int] = field(default_factory=list)
    decode_context_lens: torch.Tensor | None = None  # int64 [num_decode]


class KVCache:
    """One layer's paged cache: [num_blocks * block_size, n_kv_heads, head_dim] for K and for V."""

    def __init__(self, num_slots: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros(num_slots, n_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_slots, n_kv, head_dim, dtype=dtype, device=device)


def _slots(block_table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """The first n cache slots of a block table [max_blocks] (or [B, max_blocks] -> [B, n])."""
    offs = torch.arange(block_size, device=block_table.device)
    flat = (block_table[..., :, None] * block_size + offs).flatten(-2)
    return flat[..., :n]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        d, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args)
        self.cache: KVCache | None = None  # set by the runner for paged serving

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch | None = None
    ) -> torch.Tensor:
        """x [B, T, D] (whole sequences, causal) or [T, D] with `batch` (paged)."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary(positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if batch is None:  # [B, T, H, D] -> SDPA's [B, H, T, D]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
        else:
            out = self._paged(q, k, v, batch)
        return self.o_proj(out.reshape(*lead, self.n_heads * self.head_dim))

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: PagedBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D]: store the new K/V in their slots, attend over each sequence's context."""
        cache = self.cache
        assert cache is not None, "paged forward needs a KV cache"
        cache.k[b.slot_mapping] = k
        cache.v[b.slot_mapping] = v
        out = torch.empty_like(q)
        if b.decode_rows is not None and len(b.decode_rows):
            # One token per sequence: gather every context, padded to the longest, and mask the padding.
            starts = torch.tensor([b.q_start[i] for i in b.decode_rows.tolist()], device=q.device)
            max_ctx = int(b.decode_context_lens.max())
            slots = _slots(b.block_tables[b.decode_rows], max_ctx, b.block_size)  # [B, C]
            keys = cache.k[slots].transpose(1, 2)  # [B, KV, C, D]
            vals = cache.v[slots].transpose(1, 2)
            mask = torch.arange(max_ctx, device=q.device)[None, :] < b.decode_context_lens[:, None]  # [B, C]
            o = F.scaled_dot_product_attention(
                q[starts][:, :, None, :], keys, vals, attn_mask=mask[:, None, None, :], enable_gqa=True
            )  # [B, H, 1, D]
            out[starts] = o[:, :, 0, :]
        for i in b.prefill_rows:
            s, n, ctx = b.q_start[i], b.q_len[i], b.context_lens[i]
            slots = _slots(b.block_tables[i], ctx, b.block_size)
            keys, vals = cache.k[slots].transpose(0, 1), cache.v[slots].transpose(0, 1)  # [KV, C, D]
            qi = q[s : s + n].transpose(0, 1)  # [H, n, D]
            if n == ctx:
                o = F.scaled_dot_product_attention(qi, keys, vals, is_causal=True, enable_gqa=True)
            else:  # a chunk after cached tokens: query j sits at position ctx - n + j
                pos_q = torch.arange(ctx - n, ctx, device=q.device)
                mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None]
                o = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask, enable_gqa=True)
            out[s : s + n] = o.transpose(0, 1)
        return out


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch | None = None
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, batch: PagedBatch | None = None
    ) -> torch.Tensor:
        """Hidden states after the final norm: [B, T, D] for input_ids [B, T], or [T, D] with a paged batch."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
