"""gpt-oss's mixture of experts: a router with a bias, and experts whose MLPs carry biases and a clamped SwiGLU.

Under the checkpoint's own names (transformers' GptOssMLP): `mlp.router.{weight,bias}`, and every expert stacked in
`mlp.experts.gate_up_proj` [E, hidden, 2 * ff] (gate and up interleaved: gate in the even columns) and
`mlp.experts.down_proj` [E, ff, hidden], each with a `_bias` [E, out]. The released checkpoints ship the two
projections as MXFP4 instead (`gate_up_proj_blocks` / `_scales` [E, 2 * ff, hidden / 32, (16)] and `down_proj_…`,
each expert's weight in the [out, in] layout of a linear; kernels/mxfp4.py). They are kept as they ship: 4.25 bits
a weight in memory, decoded in the matmul, never expanded at load: on CUDA every expert of a layer at once (the
grouped Triton kernel, no host sync on the routing), on the CPU one expert at a time (a transient dequantize).

The router takes each token's top-k logits and softmaxes them (the same weights as a softmax over all experts
renormalised over the top k). An expert computes, for h = x W_gate_up + b: gate = min(h_even, limit),
up = clamp(h_odd, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate), then W_down and its bias.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.kernels import mxfp4

_TRITON = importlib.util.find_spec("triton") is not None  # else the transient dequantize, on CUDA too


def _bytes(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


class OssExperts(nn.Module):
    def __init__(self, n: int, hidden: int, ff: int, alpha: float, limit: float, packed: bool):
        super().__init__()
        self.alpha, self.limit, self.packed = alpha, limit, packed
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n, 2 * ff), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(n, hidden), requires_grad=False)
        if packed:  # uint8: untouched by the model's .to(dtype)
            self.gate_up_proj_blocks = _bytes(n, 2 * ff, hidden // 32, 16)
            self.gate_up_proj_scales = _bytes(n, 2 * ff, hidden // 32)
            self.down_proj_blocks = _bytes(n, hidden, ff // 32, 16)
            self.down_proj_scales = _bytes(n, hidden, ff // 32)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(n, hidden, 2 * ff), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(n, ff, hidden), requires_grad=False)

    def _linear(self, x: torch.Tensor, e: int, which: str) -> torch.Tensor:
        bias = getattr(self, f"{which}_bias")[e]
        if not self.packed:
            return torch.addmm(bias.to(x.dtype), x, getattr(self, which)[e])
        blocks, scales = getattr(self, f"{which}_blocks")[e], getattr(self, f"{which}_scales")[e]
        if x.device.type == "cuda" and _TRITON:
            return mxfp4.mxfp4_linear(x, blocks, scales, bias)
        return mxfp4.mxfp4_linear_ref(x, blocks, scales, bias)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's output for its tokens x [n, hidden]."""
        h = self._linear(x, e, "gate_up_proj")
        gate = h[:, 0::2].clamp(max=self.limit)
        up = h[:, 1::2].clamp(-self.limit, self.limit)
        return self._linear((up + 1) * gate * torch.sigmoid(gate * self.alpha), e, "down_proj")


class OssMoe(nn.Module):
    def __init__(self, n: int, top_k: int, hidden: int, ff: int, alpha: float, limit: float, packed: bool):
        super().__init__()
        self.router = nn.Linear(hidden, n, bias=True)
        self.experts = OssExperts(n, hidden, ff, alpha, limit, packed)
        self.top_k = top_k
        self.grouped = False  # on the CPU too (under Triton's interpreter: tests); CUDA always groups MXFP4

    def run_grouped(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert in two GEMM launches (kernels/mxfp4.py's grouped GEMM, w4a16_moe.py's slot layout): no
        host sync on the chosen experts, unlike the loop."""
        from quantserve.kernels.w4a16_moe import align_by_expert, choose_block_m

        ex = self.experts
        n_exp, slots = ex.gate_up_proj_blocks.shape[0], chosen.numel()
        block_m = max(16, choose_block_m(slots, n_exp))
        aligned = align_by_expert(chosen, n_exp, block_m)
        h = mxfp4.mxfp4_moe_gemm(flat, ex.gate_up_proj_blocks, ex.gate_up_proj_scales, ex.gate_up_proj_bias,
                                 aligned, block_m, self.top_k, slots)  # fmt: skip
        gate = h[:, 0::2].clamp(max=ex.limit)
        up = h[:, 1::2].clamp(-ex.limit, ex.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * ex.alpha)
        y = mxfp4.mxfp4_moe_gemm(act, ex.down_proj_blocks, ex.down_proj_scales, ex.down_proj_bias, aligned,
                                 block_m, 0, slots, weights)  # fmt: skip
        return y.view(-1, self.top_k, y.shape[-1]).sum(1, dtype=torch.float32).to(flat.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        top, chosen = self.router(flat).topk(self.top_k, dim=-1)
        weights = F.softmax(top.float(), dim=-1).to(flat.dtype)
        if self.experts.packed and _TRITON and (flat.is_cuda or self.grouped):
            return self.run_grouped(flat, chosen, weights).reshape(x.shape)
        return self.run_loop(flat, chosen, weights).reshape(x.shape)

    def run_loop(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert by expert, the chosen ones read on the host (no CUDA graph): the CPU's path and bf16 experts'."""
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts.expert(flat[rows], e) * weights[rows, slot, None])
        return out
