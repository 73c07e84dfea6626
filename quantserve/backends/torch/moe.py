"""A mixture-of-experts MLP (Qwen3-MoE's sparse block, and Qwen3.5-MoE's with its shared expert) for the torch
backend.

A router (`gate`, a dense linear that is never quantized) scores every expert for each token; the softmax's top-k
experts run, and their outputs are summed with those weights (renormalised to sum to 1 where the model says so,
`norm_topk_prob`). Each expert is a gated MLP under the checkpoint's own names (`mlp.experts.E.gate_proj` …), so a
state dict loads verbatim, int4 at load quantizes every expert like any linear, and the weights are stored once.

Two paths:
- grouped (`grouped` set after loading, by backends/torch/fuse.py, where every expert is a Triton W4A16 linear on
  the K-packed layout): the experts' weights stacked once, and the whole layer in two launches of
  kernels/w4a16_moe.py (vLLM's fused_moe design). Nothing is read back to the host, so a CUDA graph holds it.
- per expert, for every other case (dense experts, the CPU kernels, act-order): tokens are grouped by expert and
  each expert runs one GEMM over its tokens, as transformers' loop does. It reads which experts were chosen on the
  host, so such a model runs its decode step eagerly (no CUDA graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.kernels.w4a16_moe import MoeState, fused_moe


class Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, n_experts: int, top_k: int, renormalize: bool, shared: int = 0
    ):
        super().__init__()
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        if shared:  # Qwen3.5-MoE: one more expert for every token, weighted by sigmoid(shared_expert_gate(x))
            self.shared_expert = Expert(hidden, shared)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.shared = bool(shared)
        self.experts = nn.ModuleList(Expert(hidden, intermediate) for _ in range(n_experts))
        self.top_k = top_k
        self.renormalize = renormalize
        # calibration (converters/calibration): every expert runs on every token, so that each sees inputs to
        # quantize against; the output still sums the routed experts only
        self.calibrate_all = False
        self.grouped: tuple[MoeState, MoeState] | None = None  # (gate|up, down) of every expert, stacked

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [N, k] and their weights [N, k] (in x's dtype), for x [N, hidden]."""
        chosen, weights = self.choose(self.gate(x))
        return chosen, weights.to(x.dtype)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts [N, k] and their fp32 weights for the router's logits [N, n_experts]."""
        probs = F.softmax(logits.float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(flat)
        if self.grouped is not None and not self.calibrate_all:  # (calibration runs dense experts)
            interpret = flat.device.type == "cpu"  # Triton runs CPU tensors only in its interpreter (tests)
            return fused_moe(flat, *self.grouped, chosen, weights, interpret=interpret).reshape(x.shape)
        out = torch.zeros_like(flat)
        if self.calibrate_all:
            for e, expert in enumerate(self.experts):
                routed = (weights * (chosen == e)).sum(dim=-1, keepdim=True)  # 0 where e was not chosen
                out += expert(flat) * routed
            return out.reshape(x.shape)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)
