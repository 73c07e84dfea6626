"""A compact Llama-family transformer (llama, mistral, qwen2, qwen3) in plain PyTorch, in the spirit of gpt-fast.

Module and parameter names are the HF checkpoint's (`model.layers.3.self_attn.q_proj.weight`), so a state dict loads
verbatim. Two ways to run it:
- `forward(input_ids [B, T])`: causal attention over whole sequences, no cache (tests, calibration);
- `forward(input_ids [T], positions [T], step)`: a flattened batch of many sequences' new tokens against a paged KV
  cache (the engine); `step` (backends/torch/step.py) says where each sequence's tokens are and where their K/V go.
The model keeps one rotary table; a forward looks its positions up once and hands every layer the same cos/sin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.backends.torch.step import StepBatch
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
    """The model's one rotary table: cos and sin of every position up to the longest seen so far, in fp32 (HF's
    rotate_half layout: halves, not pairs). It grows by doubling; a lookup is an index, the same values as
    computing them (positions x inverse frequencies, then cos/sin)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos = self._sin = torch.empty(0)

    def _grow(self, n: int, device: torch.device) -> None:
        size = max(256, 1 << (n - 1).bit_length())
        freqs = torch.arange(size, device=device).float()[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def forward(self, positions: torch.Tensor, max_position: int | None = None) -> Rope:
        """cos, sin [T, head_dim] for positions [T]; `max_position` (the largest, if the caller knows it) saves a
        look at the device tensor."""
        top = max_position if max_position is not None else int(positions.max()) if positions.numel() else 0
        if top >= self._cos.shape[0] or self._cos.device != positions.device:
            self._grow(top + 1, positions.device)
        return self._cos[positions], self._sin[positions]


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, head_dim] of the tokens at hand


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


class KVCache:
    """One layer's paged cache: [num_blocks * block_size, n_kv_heads, head_dim] for K and for V."""

    def __init__(self, num_slots: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros(num_slots, n_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_slots, n_kv, head_dim, dtype=dtype, device=device)


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
        self.cache: KVCache | None = None  # set by the runner for paged serving

    def forward(self, x: torch.Tensor, rope: Rope, step: StepBatch | None = None) -> torch.Tensor:
        """x [B, T, D] (whole sequences, causal) or [T, D] with `step` (paged)."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if step is None:  # [B, T, H, D] -> SDPA's [B, H, T, D]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
        else:
            out = self._paged(q, k, v, step)
        return self.o_proj(out.reshape(*lead, self.n_heads * self.head_dim))

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D]: store the new K/V in their slots, then attend over each sequence's context:
        one call for the decoding sequences, one for the prefilling ones (all indices prepared once per step)."""
        cache = self.cache
        assert cache is not None, "paged forward needs a KV cache"
        cache.k[step.slot_mapping] = k
        cache.v[step.slot_mapping] = v
        out = torch.empty_like(q)
        if (d := step.decode) is not None:
            keys = cache.k[d.kv_slots].transpose(1, 2)  # [B, KV, C, D]
            vals = cache.v[d.kv_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[d.q_index][:, :, None, :], keys, vals, attn_mask=d.mask, enable_gqa=True
            )  # [B, H, 1, D]
            out[d.q_index] = o[:, :, 0, :]
        if (p := step.prefill) is not None:
            keys = cache.k[p.kv_slots].transpose(1, 2)  # [P, KV, C, D]
            vals = cache.v[p.kv_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[p.q_index].transpose(1, 2), keys, vals, attn_mask=p.mask, enable_gqa=True
            )  # [P, H, Q, D]
            out[p.q_index[p.q_valid]] = o.transpose(1, 2)[p.q_valid]
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

    def forward(self, x: torch.Tensor, rope: Rope, step: StepBatch | None = None) -> torch.Tensor:
        """x [B, T, D] or [T, D] (with `step`); `rope` is the model's cos/sin for these tokens' positions."""
        h = x + self.self_attn(self.input_layernorm(x), rope, step)
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
        self.rotary = RotaryEmbedding(args)

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
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, rope, step)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
