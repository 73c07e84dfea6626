"""Attention over whole sequences or gathered context, in PyTorch: SDPA where it applies, else fp32 as transformers'
eager attention computes it (Gemma 2's soft caps, gpt-oss's sinks), a slice of the queries at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, Q, D] over k, v [B, KV, C, D]; `mask` bool, broadcastable to [B, H, Q, C] (True:
    attend), None: causal. With `softcap`, the scores are capped by softcap * tanh(s / softcap) before the
    softmax (Gemma 2); with `sinks` [H], each head's softmax has one more logit, attending to nothing (gpt-oss).
    SDPA does neither: those are computed in fp32 as transformers' eager attention does, a slice of the queries
    at a time, so that the scores stay within _EAGER_SCORES bytes whatever the context."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    b, h, nq, _ = q.shape
    c = k.shape[2]
    if mask is None:
        mask = torch.ones(nq, c, dtype=torch.bool, device=q.device).tril(c - nq)
    k, v = k.float(), v.float()
    rows = max(1, _EAGER_SCORES // (b * h * c * 4))
    outs = [
        _eager(q[:, :, i : i + rows], k, v, mask if mask.shape[-2] == 1 else mask[..., i : i + rows, :],
               scale, softcap, sinks)
        for i in range(0, nq, rows)
    ]  # fmt: skip
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


_EAGER_SCORES = 128 * 2**20  # bytes of fp32 scores per slice of queries in attend's eager path


def _eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """attend() in fp32 for q [B, H, Q, D] over fp32 k, v [B, KV, C, D]: each KV head's G query heads in one
    product against its keys (grouped-query attention without repeating K and V)."""
    b, h, nq, d = q.shape
    kv, c = k.shape[1], k.shape[2]
    s = (q.float().reshape(b, kv, h // kv * nq, d) @ k.transpose(-1, -2)).view(b, h, nq, c) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = s.softmax(-1)
    else:  # the sink's logit joins the max and the sum, and brings no value
        sink = sinks.float()[None, :, None]
        top = torch.maximum(s.amax(-1), sink)
        p = (s - top[..., None]).exp_()
        p = p / (p.sum(-1) + (sink - top).exp())[..., None]
    return (p.view(b, kv, h // kv * nq, c) @ v).view(b, h, nq, d).to(q.dtype)


def window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [T, T]: causal, within the last `window` positions (transformers' sliding-window mask)."""
    i = torch.arange(t, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
