"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3.6 (and Qwen3-Next): three of every four layers.

Under the checkpoint's names (transformers' Qwen3_5GatedDeltaNet): `in_proj_qkv` gives q, k and v side by side,
which a causal depthwise conv1d (`conv1d`, kernel 4, no bias) then SiLU mixes over the last few tokens; `in_proj_z`
the output gate, `in_proj_b` the write strength beta = sigmoid(b), `in_proj_a` with `A_log` and `dt_bias` the decay
g = -exp(A_log) * softplus(a + dt_bias) (a log, per head and token). q and k are L2-normalised (q also scaled by
1/sqrt(d_k)), and the key heads are repeated to the value heads. Each value head keeps a state S [d_k, d_v], and each
token t does (the gated delta rule):

    S <- exp(g_t) S;    S <- S + k_t (beta_t (v_t - S^T k_t))^T;    o_t = S^T q_t

Then `norm` (an RMSNorm over each head, times silu(z)) and `out_proj`. Nothing grows with the context: a sequence's
state is its conv window (the last kernel - 1 inputs) and S, a fixed size. The engine gives each running sequence
a state slot (its ledger, quantserve.engine.kv) and the runner keeps every slot's state here (`RecurrentState`).

Two exact forms of the rule, in fp32 as transformers computes it:
- `delta_rule_recurrent`, token by token: decoding (one token), and the reference;
- `delta_rule_chunked`, 64 tokens at a time (the WY form of Yang et al., "Gated Delta Networks"): within a chunk,
  with G the cumulative log decay, A[t, i] = beta_t exp(G_t - G_i) k_t . k_i (i < t) and T = (I + A)^-1, the
  corrected values are U = T (beta V) - T (beta exp(G) K) S0; then O = exp(G) Q S0 + (Q K^T o exp(G_t - G_i))_{i<=t}
  U and S = exp(G_last) S0 + (K exp(G_last - G))^T U. Prefill, whole sequences, and chunks of a prompt carry S over.
On CUDA (and in tests under TRITON_INTERPRET=1) the engine's steps run as Triton kernels instead (kernels/deltanet.py,
`triton_ops`): a decoding step as one kernel over every decoding sequence's state in place, and a prefill chunk as
the chunked form in one kernel (16 tokens a chunk), its slot's state in place. The whole-sequence forward (no
engine step: tests, calibration) stays PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.kernels import deltanet as kernel

CHUNK = 64
# The projections a checkpoint may quantize (W4A16): in_proj_a and in_proj_b give one output per value head, too
# few for the kernels' tiles, and stay dense with the conv, A_log, dt_bias and the norm.
QUANTIZABLE = ("in_proj_qkv", "in_proj_z", "out_proj")


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, H, dk] (normalised), v [B, T, H, dv], g and beta [B, T, H], state [B, H, dk, dv], all fp32 ->
    (o [B, T, H, dv], the state after the last token)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(-2)
    return out, state


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_recurrent's result, `chunk` tokens at a time (the module docstring's WY form)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    outs = []
    for c0 in range(0, q.shape[2], chunk):
        qc, kc, vc = q[:, :, c0 : c0 + chunk], k[:, :, c0 : c0 + chunk], v[:, :, c0 : c0 + chunk]
        gc, bc = g[:, :, c0 : c0 + chunk], beta[:, :, c0 : c0 + chunk]
        n = qc.shape[2]
        cum = gc.cumsum(-1)  # G
        diff = cum[..., :, None] - cum[..., None, :]  # G_t - G_i
        ones = torch.ones(n, n, dtype=torch.bool, device=q.device)
        strict, incl = ones.tril(-1), ones.tril()
        a = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * diff.masked_fill(~strict, float("-inf")).exp()
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
        u = inv @ (bc[..., None] * vc) - (inv @ ((bc * cum.exp())[..., None] * kc)) @ state
        scores = (qc @ kc.transpose(-1, -2)) * diff.masked_fill(~incl, float("-inf")).exp()
        outs.append((cum.exp()[..., None] * qc) @ state + scores @ u)
        last = cum[..., -1:]
        state = last.exp()[..., None] * state + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(outs, dim=2).transpose(1, 2), state


@dataclass
class RecurrentState:
    """Every state slot of one layer: the conv window [S, conv_dim, kernel - 1] in the model's dtype, and the delta
    state [S, H_v, d_k, d_v] in fp32."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def empty(
        cls, slots: int, layer: GatedDeltaNet, dtype: torch.dtype, device: torch.device
    ) -> RecurrentState:
        return cls(
            torch.zeros(slots, layer.conv_dim, layer.kernel - 1, dtype=dtype, device=device),
            torch.zeros(slots, layer.n_v, layer.d_k, layer.d_v, dtype=torch.float32, device=device),
        )

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[0].numel() * self.conv.element_size()) + self.ssm[0].numel() * 4


def state_bytes(conv_dim: int, kernel: int, n_v: int, d_k: int, d_v: int, elem_bytes: int) -> int:
    """One sequence's state in one layer, in bytes (the plan's and inspect's figure)."""
    return conv_dim * (kernel - 1) * elem_bytes + n_v * d_k * d_v * 4


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNormGated: each head normalised in fp32, scaled in the input's dtype, times
    silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, n_k: int, n_v: int, d_k: int, d_v: int, kernel: int, eps: float):
        super().__init__()
        self.n_k, self.n_v, self.d_k, self.d_v, self.kernel = n_k, n_v, d_k, d_v, kernel
        self.key_dim, self.value_dim = n_k * d_k, n_v * d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, n_v, bias=False)
        self.in_proj_a = nn.Linear(hidden, n_v, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(n_v))
        self.A_log = nn.Parameter(torch.zeros(n_v))
        self.norm = GatedRMSNorm(d_v, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.state: RecurrentState | None = None  # set by the runner for serving
        self.triton_ops = False  # decoding steps in kernels/deltanet.py: set by Transformer.use_fused_kernels

    def forward(self, x: torch.Tensor, step=None) -> torch.Tensor:
        """x [B, T, D] (whole sequences from a zero state) or [T, D] with the engine's `step` (backends/torch/step.py
        StepBatch: its `recurrent` segments say which tokens belong to which state slot)."""
        lead = x.shape[:-1]
        qkv = self.in_proj_qkv(x)
        if step is None:
            mixed = F.silu(F.conv1d(qkv.transpose(1, 2), self.conv1d.weight, padding=self.kernel - 1,
                                    groups=self.conv_dim)[..., : x.shape[1]]).transpose(1, 2)  # fmt: skip
            state = x.new_zeros(x.shape[0], self.n_v, self.d_k, self.d_v, dtype=torch.float32)
            o = self._rule(mixed, self.in_proj_b(x), self.in_proj_a(x), state)[0]
        else:
            o = self._paged(x, qkv, step)
        z = self.in_proj_z(x).view(*lead, self.n_v, self.d_v)
        return self.out_proj(self.norm(o, z).reshape(*lead, self.value_dim))

    def _inputs(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rule's fp32 inputs from mixed [B, T, conv_dim] (after the conv) and the b, a projections: q, k
        [B, T, H_k, d_k] (normalised, q scaled), v [B, T, H_v, d_v], g and beta [B, T, H_v]."""
        bsz, t, _ = mixed.shape
        q, k, v = mixed.float().split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = _l2norm(q.view(bsz, t, self.n_k, self.d_k)) * self.d_k**-0.5
        k = _l2norm(k.view(bsz, t, self.n_k, self.d_k))
        beta = b.sigmoid().float()  # in the projection's dtype, then widened, as transformers and fla do
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v.view(bsz, t, self.n_v, self.d_v), g, beta

    def _rule(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta rule over mixed [B, T, conv_dim] (after the conv) from `state` [B, H_v, d_k, d_v] ->
        (o [B, T, H_v, d_v] in the input's dtype, the new state)."""
        q, k, v, g, beta = self._inputs(mixed, b, a)
        if self.n_v != self.n_k:
            q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
            k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
        rule = delta_rule_recurrent if mixed.shape[1] == 1 else delta_rule_chunked
        o, state = rule(q, k, v, g, beta, state)
        return o.to(mixed.dtype), state

    def _paged(self, x: torch.Tensor, qkv: torch.Tensor, step) -> torch.Tensor:
        """Each segment (first token, count, slot, fresh) continues its slot's state, or starts from zero. The
        one-token segments (decoding sequences) go together, gathered by slot; a prefill chunk goes on its own."""
        st = self.state
        assert st is not None, "paged forward needs the layer's recurrent state"
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        out = x.new_empty(x.shape[0], self.n_v, self.d_v)
        for _, _, slot, fresh in step.recurrent:
            if fresh:
                st.conv[slot].zero_()
                st.ssm[slot].zero_()
        rows, slots = getattr(step, "single_rows", None), getattr(step, "single_slots", None)
        if rows is None:  # (a step made by hand: tests)
            single = [(first, slot) for first, n, slot, _ in step.recurrent if n == 1]
            rows = torch.tensor([r for r, _ in single], dtype=torch.long, device=x.device)
            slots = torch.tensor([s for _, s in single], dtype=torch.long, device=x.device)
        if rows.numel():
            window = torch.cat(
                (st.conv[slots], qkv[rows, :, None].to(st.conv.dtype)), dim=-1
            )  # [B, C, kernel]
            st.conv[slots] = window[..., 1:]
            mixed = F.silu(F.conv1d(window, self.conv1d.weight, groups=self.conv_dim)).transpose(
                1, 2
            )  # [B, 1, C]
            if self.triton_ops:  # one kernel, each state updated in its slot
                q, k, v, g, beta = self._inputs(mixed.to(x.dtype), b[rows, None], a[rows, None])
                o = kernel.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], st.ssm, slots)
                out[rows] = o.to(x.dtype)
            else:
                o, new = self._rule(mixed.to(x.dtype), b[rows, None], a[rows, None], st.ssm[slots])
                st.ssm[slots] = new
                out[rows] = o[:, 0]
        for first, n, slot, _ in step.recurrent:
            if n == 1:
                continue
            window = torch.cat((st.conv[slot], qkv[first : first + n].T.to(st.conv.dtype)), dim=-1)
            st.conv[slot] = window[:, -(self.kernel - 1) :]
            mixed = F.silu(F.conv1d(window[None], self.conv1d.weight, groups=self.conv_dim)).transpose(1, 2)
            if self.triton_ops:  # the chunked form in one kernel, the slot's state updated in place
                q, k, v, g, beta = self._inputs(
                    mixed.to(x.dtype), b[None, first : first + n], a[None, first : first + n]
                )
                out[first : first + n] = kernel.prefill(q[0], k[0], v[0], g[0], beta[0], st.ssm, slot).to(
                    x.dtype
                )
                continue
            o, new = self._rule(mixed.to(x.dtype), b[None, first : first + n], a[None, first : first + n],
                                st.ssm[slot][None])  # fmt: skip
            st.ssm[slot] = new[0]
            out[first : first + n] = o[0]
        return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm: x / sqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
