"""Rotary position embeddings: the inverse frequencies of every rope_scaling kind transformers knows for these
models (default, linear, llama3, yarn, longrope), the model's cos/sin table, and its application to q and k."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from quantserve.backends.torch.model import ModelArgs


def rope_inv_freq(args: ModelArgs, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the attention scaling of cos/sin, as transformers'
    `ROPE_INIT_FUNCTIONS` compute them for default, linear, llama3, yarn and longrope (`long`: its factors for
    sequences past the original context)."""
    dim, base = args.rotary_dim or args.head_dim, args.rope_theta
    # fp32 like transformers, so that both models see the same frequencies. On the CPU even while the model is
    # built on the meta device (where arange goes through torch's Python references, which import torch._dynamo:
    # 1.4-1.8 s of a process's first load); the loader computes the table again on the model's device.
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=cpu) / dim))
    s = dict(args.rope_scaling)
    kind = s.get("rope_type", "default")
    if kind == "longrope":  # Phi-3: a factor per frequency, short or long, and one attention scaling for both
        orig = s["original_max_position_embeddings"]
        factor = args.max_position_embeddings / orig
        scaling = s.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
        )
        ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32, device=cpu)
        return (
            1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=cpu) / dim))
        ).float(), scaling
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
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=cpu) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        return inv.float(), float(attention_factor)
    return inv_freq.float(), 1.0


class RotaryEmbedding(nn.Module):
    """The model's rotary table: cos and sin of every position up to the longest seen so far, in fp32 (HF's
    rotate_half layout: halves, not pairs). It grows by doubling; a lookup is an index, the same values as
    computing them (positions x inverse frequencies, then cos/sin). LongRoPE has a second table, for a forward
    whose longest position is past the original context, as transformers switches (longrope_frequency_update)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = (
            args  # what the loader re-initialises it from, after building the model on the meta device
        )
        inv_freq, self.attention_scaling = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        s = dict(args.rope_scaling)
        self.switch_at = s["original_max_position_embeddings"] if s.get("rope_type") == "longrope" else None
        if self.switch_at is not None:
            self.register_buffer("inv_freq_long", rope_inv_freq(args, long=True)[0], persistent=False)
        self._tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def _grow(self, n: int, device: torch.device, long: bool) -> None:
        size = max(256, 1 << (n - 1).bit_length())
        inv = (self.inv_freq_long if long else self.inv_freq).to(device)
        freqs = torch.arange(size, device=device).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._tables[long] = (emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling)

    def forward(self, positions: torch.Tensor, max_position: int | None = None) -> Rope:
        """cos, sin [T, head_dim] for positions [T]; `max_position` (the largest, if the caller knows it) saves a
        look at the device tensor."""
        top = max_position if max_position is not None else int(positions.max()) if positions.numel() else 0
        long = self.switch_at is not None and top + 1 > self.switch_at
        cos, _ = self._tables.get(long, (torch.empty(0), None))
        if top >= cos.shape[0] or cos.device != positions.device:
            self._grow(top + 1, positions.device, long)
        cos, sin = self._tables[long]
        return cos[positions], sin[positions]


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, head_dim] of the tokens at hand


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin [T, R]: the first R dimensions of each head rotate (R < D: partial rotary, as
    transformers' Phi-3 splits q and k), the rest pass through."""
    r = cos.shape[-1]
    x1, x2 = x[..., :r].chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (x[..., :r].float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)
