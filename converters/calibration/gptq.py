"""GPTQ (Frantar et al. 2022): Hessian-aware column-by-column quantization of one linear layer.

Follows the reference algorithm (IST-DASLab/gptq gptq.py, AutoGPTQ auto_gptq/quantization/gptq.py): Hessian
H = 2/n Σ x xᵀ, dampening, the upper Cholesky factor of H⁻¹, lazy block updates, group parameters fixed when
the column sweep enters a group, optional act-order (docs/quantized-checkpoints.md, "GPTQ act-order and
g_idx") and static groups.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from quantserve.errors import ConfigError
from quantserve.kernels.qweight import QuantizedWeight
from quantserve.quant.rtn import GroupQuantizer, check_quant_args, to_quantized_weight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTQResult:
    weight: QuantizedWeight
    wq: torch.Tensor  # float32 [N, K]: the weights GPTQ settled on, == weight.dequantize().T exactly
    loss: float  # ‖(W − Ŵ) X‖² per calibration row (summed over outputs), from GPTQ's own error terms
    damp_percent: float  # the dampening actually used (raised when H was not positive definite)


class GPTQ:
    """Accumulates one linear's input Hessian, then quantizes its weight.

    Usage: `g = GPTQ(K)`; `g.add_batch(x)` for every calibration batch (x [*, K], the linear's input);
    `g.quantize(w, bits, group_size, sym, act_order=...)` -> QuantizedWeight, or `g.fasterquant(...)` ->
    GPTQResult (with the settled weights and the loss).
    """

    def __init__(self, columns: int, device: torch.device | str | None = None):
        self.columns = columns
        self.device = device
        self.H: torch.Tensor | None = None
        self.nsamples = 0  # rows (tokens) seen: H is their running mean, independent of how they are batched

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        if x.shape[1] != self.columns:
            raise ValueError(f"GPTQ expects inputs with {self.columns} features; got {tuple(x.shape)}")
        if self.H is None:
            device = self.device if self.device is not None else x.device
            self.H = torch.zeros(self.columns, self.columns, dtype=torch.float32, device=device)
        n = x.shape[0]
        if n == 0:
            return
        # Running average (as in the reference), so H = 2/n Σ x xᵀ over everything seen, in fp32.
        self.H *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        x = x.to(self.H.device, torch.float32) * math.sqrt(2 / self.nsamples)
        self.H.addmm_(x.t(), x)

    def quantize(
        self, w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True, **kw
    ) -> QuantizedWeight:
        """Like fasterquant, returning only the QuantizedWeight."""
        return self.fasterquant(w, bits, group_size, sym, **kw).weight

    def fasterquant(self, w: torch.Tensor, *args, **kw) -> GPTQResult:
        """Quantize w [N, K] (nn.Linear layout) against the accumulated Hessian: fasterquant_all of one linear,
        with the same arguments after `w`."""
        (r,) = self.fasterquant_all([w], *args, **kw)
        return r

    def fasterquant_all(
        self,
        ws: list[torch.Tensor],
        bits: int = 4,
        group_size: int = 128,
        sym: bool = True,
        act_order: bool = False,
        damp_percent: float = 0.01,
        block_size: int = 128,
        static_groups: bool = False,
        scale_dtype: torch.dtype = torch.float16,
        name: str = "weight",
        keep_hessian: bool = False,
    ) -> list[GPTQResult]:
        """Quantize the linears `ws` [N_i, K], which all read this Hessian's input (q, k and v; gate and up), in
        one column sweep over their rows stacked; frees the Hessian. GPTQ treats each row on its own (its group
        parameters, its rounding and the error it feeds forward all stay in the row; H⁻¹ is shared), so each
        result is the one that linear gets alone, up to float rounding, and the per-column steps run once.

        act_order processes columns by decreasing diag(H), forming groups in that order (g_idx records them;
        docs/quantized-checkpoints.md, "GPTQ act-order and g_idx"); static_groups fixes every group's
        parameters up front on the natural column order, so that g_idx stays trivial (and is dropped).
        keep_hessian leaves H in place for other linears that read the same input at another setting;
        otherwise it is freed.

        Raises:
            ConfigError: bad bits/group_size, K not a multiple of group_size, or no calibration data.
        """
        k = ws[0].shape[1]
        g = check_quant_args(k, bits, group_size, name)
        if self.H is None or self.nsamples == 0:
            raise ConfigError(f"{name}: GPTQ needs calibration inputs; none reached this layer")
        H = self.H.clone() if keep_hessian else self.H
        if not keep_hessian:
            self.H = None
        W = torch.cat([w.detach().to(H.device, torch.float32) for w in ws])
        n_rows = W.shape[0]
        quantizer = GroupQuantizer(bits, sym, scale_dtype)

        dead = torch.diag(H) == 0  # inputs that were always 0: their weights cannot matter, make them 0
        H[dead, dead] = 1
        W[:, dead] = 0
        n_groups = k // g
        scales = torch.zeros(n_rows, n_groups, device=W.device)
        zeros = torch.zeros_like(scales)
        if static_groups:
            s, z = quantizer.find_params(W.reshape(n_rows, n_groups, g))
            scales, zeros = s[..., 0], z[..., 0]
        # The sweep runs on W's columns as rows (Wt [K, N]), each column one contiguous vector (and act-order's
        # permutation a gather of rows).
        Wt = W.t().contiguous()
        perm, order = None, range(k)
        if act_order:
            perm = torch.argsort(torch.diag(H), descending=True)
            Wt, H = Wt[perm], H[perm][:, perm]
            order = perm.tolist()  # host copy: no device sync per column
        Hinv, damp = _inverse_cholesky(H, damp_percent, name)
        lam = damp * float(torch.diag(H).mean())
        del H

        # A block's errors are fed forward lazily: a column's share of them is one matrix-vector product, taken
        # when the sweep reaches it. That is a handful of small calls per column, where the reference's eager
        # rank-1 update of the rest of the block cost several times as long on the CPU.
        Qt = torch.zeros_like(Wt)  # integer values, in processing order
        Wqt = torch.zeros_like(Wt)
        loss = torch.zeros(n_rows, device=W.device)  # each row's Σ err²
        scale = zero = None
        for i1 in range(0, k, block_size):
            i2 = min(i1 + block_size, k)
            Err1 = torch.zeros(i2 - i1, n_rows, device=W.device)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if static_groups:
                    grp = order[col] // g
                    scale, zero = scales[:, grp], zeros[:, grp]
                elif col % g == 0:
                    # Entering a group: its parameters come from its columns as updated so far (also those
                    # past this block, which have this block's feedback pending).
                    cur = Wt[col : col + g] - Hinv[i1:col, col : col + g].T @ Err1[:i]
                    scale, zero = (x[:, 0] for x in quantizer.find_params(cur.T))
                    scales[:, col // g], zeros[:, col // g] = scale, zero
                w = Wt[col] - Hinv1[:i, i] @ Err1[:i]
                q = quantizer.quantize(w, scale, zero)
                wq = quantizer.dequantize(q, scale, zero)
                Qt[col], Wqt[col] = q, wq
                err = (w - wq) / Hinv1[i, i]
                loss += err.square()
                Err1[i] = err
            Wt[i2:] -= Hinv[i1:i2, i2:].T @ Err1

        g_idx = None
        if perm is not None:
            inv = torch.argsort(perm)
            Qt, Wqt = Qt[inv], Wqt[inv]
            if not static_groups:
                g_idx = (torch.arange(k, device=W.device) // g)[inv]
        Q, Wq = Qt.T, Wqt.T.contiguous()
        results, start = [], 0
        for w in ws:
            rows = slice(start, start + w.shape[0])
            start = rows.stop
            w0 = w.detach().to(Wq.device, torch.float32)  # W was updated in place; ΔW is from the original
            delta = torch.where(dead[None, :], torch.zeros_like(w0), w0 - Wq[rows])
            # Σ err² = tr(ΔW (H + λI) ΔWᵀ) exactly (OBS), and tr(ΔW H ΔWᵀ) = 2/n ‖ΔW X‖².
            per_row = (float(loss[rows].sum()) - lam * float(delta.pow(2).sum())) / 2
            weight = to_quantized_weight(
                Q[rows], scales[rows], zeros[rows], quantizer, group_size, g_idx
            ).with_trivial_g_idx_dropped()
            results.append(GPTQResult(weight, Wq[rows], max(per_row, 0.0), damp))
        return results

    def round_to_grid(
        self,
        w: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        lo: int,
        hi: int,
        act_order: bool = True,
        damp_percent: float = 0.01,
        block_size: int = 128,
        name: str = "weight",
        keep_hessian: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GPTQ's rounding onto a grid fixed in advance: weight (i, j) may take scale[i, j]·q + offset[i, j] for
        an integer q in [lo, hi] (a GGUF block's values once llama.cpp chose its scales; gguf/codes.py).

        The column sweep and its error feedback are fasterquant's; only the candidate values differ, and since
        they do not depend on the sweep, act_order needs no g_idx. Returns (int32 codes, the settled float32
        weights), both [N, K].
        """
        if self.H is None or self.nsamples == 0:
            raise ConfigError(f"{name}: GPTQ needs calibration inputs; none reached this layer")
        H = self.H.clone() if keep_hessian else self.H
        if not keep_hessian:
            self.H = None
        dev = H.device
        W = w.detach().to(dev, torch.float32).clone()
        S, Off = scale.to(dev, torch.float32), offset.to(dev, torch.float32)
        inv = torch.where(S != 0, 1 / S, torch.zeros_like(S))
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0
        # As fasterquant_all sweeps: columns as rows, the block's feedback applied when a column is reached.
        Wt, St, Offt, invt = (x.t().contiguous() for x in (W, S, Off, inv))
        perm = None
        if act_order:
            perm = torch.argsort(torch.diag(H), descending=True)
            Wt, St, Offt, invt, H = Wt[perm], St[perm], Offt[perm], invt[perm], H[perm][:, perm]
        Hinv, _ = _inverse_cholesky(H, damp_percent, name)
        del H
        k = W.shape[1]
        Qt = torch.zeros_like(Wt)
        for i1 in range(0, k, block_size):
            i2 = min(i1 + block_size, k)
            Hinv1 = Hinv[i1:i2, i1:i2]
            Err1 = torch.zeros(i2 - i1, Wt.shape[1], device=dev)
            for i in range(i2 - i1):
                c = i1 + i
                w = Wt[c] - Hinv1[:i, i] @ Err1[:i]
                q = torch.clamp(torch.round((w - Offt[c]) * invt[c]), lo, hi)
                Qt[c] = q
                Err1[i] = (w - (St[c] * q + Offt[c])) / Hinv1[i, i]
            Wt[i2:] -= Hinv[i1:i2, i2:].T @ Err1
        Q = (Qt if perm is None else Qt[torch.argsort(perm)]).T
        return Q.to(torch.int32), (scale.to(dev, torch.float32) * Q + offset.to(dev, torch.float32))


def _inverse_cholesky(H: torch.Tensor, damp_percent: float, name: str) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹; raises the dampening until H is positive
    definite (as GPTQModel's damp_auto_increment does), up to 100 %."""
    diag = torch.arange(H.shape[0], device=H.device)
    mean = torch.diag(H).mean()
    damp = damp_percent
    while damp <= 1.0:
        Hd = H.clone()
        Hd[diag, diag] += damp * mean
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if int(info) == 0:
                if damp != damp_percent:
                    log.warning("%s: Hessian not positive definite; dampening raised to %.4f", name, damp)
                return U, damp
        damp = damp + 0.01 if damp >= 0.01 else 0.01
    raise ConfigError(
        f"{name}: the calibration Hessian stays singular even with 100 % dampening; calibrate on more or "
        "more varied text (--calib FILE)"
    )
