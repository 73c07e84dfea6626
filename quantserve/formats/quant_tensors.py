"""Decode one quantized linear's checkpoint tensors (GPTQ, AWQ, compressed-tensors, Marlin) into a QuantizedWeight,
or an FP8 one's into an Fp8Weight.

Pure functions over tensors already in memory: the reader (quant_read.py) finds the tensors and the per-layer
settings, these turn them into the canonical form. Section names refer to docs/quantized-checkpoints.md.
The decoders of the four layouts stay side by side in this one file on purpose: they share the word arithmetic
and the error wording, and their conventions (packing axis, zero-point form) are easiest to check against each
other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.kernels import grouping
from quantserve.kernels.fp8 import Fp8Weight
from quantserve.kernels.grouping import SUPPORTED_BITS
from quantserve.kernels.mxfp4 import Mxfp4Weight
from quantserve.kernels.nvfp4 import Nvfp4Weight
from quantserve.kernels.packing import pack, packed_len, unpack
from quantserve.kernels.qweight import QuantizedWeight, QuantLayoutError

logger = logging.getLogger(__name__)

Get = Callable[[str], torch.Tensor | None]  # tensor suffix ("qweight") -> this layer's tensor, or None

# AWQ GEMM interleave ("AWQ GEMM layout"): slot p of a word holds logical column 8c + AWQ_ORDER[p];
# column 8c + j sits in slot AWQ_INV[j] (AutoAWQ's AWQ_REVERSE_ORDER, vLLM's undo_pack).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_INV = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class LayerQuant:
    """The settings that apply to one linear: the config after per-module overrides (GPTQModel `dynamic`,
    compressed-tensors `config_groups`).

    zero_format: GPTQ only: "v1" (zeros minus one), "v2" (raw) or "auto" (no checkpoint_format given: v1
    unless the stored symmetric zeros are already 2^(bits-1): the content heuristic of "GPTQ zero points").
    packing: compressed-tensors only: "word" (32 // bits values per word, compressed-tensors < 0.18) or
    "dense" (bitstream, >= 0.18); "auto" picks by the tensor width ("compressed-tensors packing").
    from_shapes: derive bits and group size from the tensor shapes when they disagree with the config
    ("Telling layouts apart", used with GPTQModel `dynamic`).
    block: FP8 only: the (rows, columns) one scale covers, as the config states it; None: per-tensor or
    per-channel, told apart by the scale's shape ("FP8").
    """

    bits: int
    group_size: int
    sym: bool = True
    zero_format: str = "v1"
    packing: str = "dense"
    from_shapes: bool = False
    block: tuple[int, int] | None = None


def _error(
    name: str, what: str, fix: str = "re-export the checkpoint or fix its quantization config"
) -> Exception:
    return ModelFileError(f"tensor '{name}': {what}; {fix}")


def _need(get: Get, prefix: str, suffix: str, dims: int = 2) -> torch.Tensor:
    t = get(suffix)
    if t is None:
        raise _error(
            f"{prefix}.{suffix}", "missing from the checkpoint", "download the missing shard or file"
        )
    if t.dim() != dims:
        raise _error(f"{prefix}.{suffix}", f"expected {dims}-D, got shape {list(t.shape)}")
    return t


def _int_tensor(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in (torch.int32, torch.uint32):
        raise _error(name, f"packed words must be I32, got {t.dtype}")
    return t.view(torch.int32)


def _finish(prefix: str, w: QuantizedWeight) -> QuantizedWeight:
    """Drop symmetric zeros and trivial g_idx (fast paths apply), then validate naming the layer."""
    if w.zeros is not None and bool((w.zeros == 1 << (w.bits - 1)).all()):
        w = QuantizedWeight(w.qweight, w.scales, None, w.bits, w.group_size, w.g_idx)
    try:
        return w.with_trivial_g_idx_dropped().validate(prefix)
    except QuantLayoutError as e:
        raise ModelFileError(f"{e}; re-export the checkpoint") from None


def _check_bits(name: str, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise UnsupportedFormatError(
            f"tensor '{name}': {bits}-bit weights are not supported (supported: {SUPPORTED_BITS}); "
            "re-quantize to 4 or 8 bits"
        )


def _group_from_shapes(name: str, k: int, n_groups: int, group_size: int, derive: bool) -> int:
    """The group size, checked against the number of scale rows over K (or derived from it)."""
    if grouping.n_groups(k, group_size) == n_groups:
        return group_size
    if derive and n_groups == 1:
        return -1
    if derive and n_groups > 0 and k % n_groups == 0:
        return k // n_groups
    raise _error(
        name,
        f"{n_groups} scale groups over K = {k} contradict group_size {group_size} "
        f"(which needs {grouping.n_groups(k, group_size)})",
    )


# ---- word arithmetic -------------------------------------------------------------------------------


def _u32(words: torch.Tensor) -> torch.Tensor:
    return words.to(torch.int64) & 0xFFFFFFFF


def _i32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _ones_words(bits: int) -> torch.Tensor:
    """The words holding a 1 in every slot: 0x11111111 for 4-bit, 0x01010101 for 8-bit, three words for 3-bit."""
    return _u32(pack(torch.ones(1, 32, dtype=torch.uint8), bits, dim=1)[0])


def v1_zero_words(qzeros: torch.Tensor, bits: int, sign: int) -> torch.Tensor:
    """Add (sign=+1, reading) or subtract (sign=-1, writing) one per slot as whole-word arithmetic mod 2^32.

    GPTQModel's v1<->v2 converters do exactly this, so borrows from a zero of 0 propagate and come back
    ("GPTQ zero points"). For 3-bit the constant repeats every 3 words; it is the dense bitstream of ones
    ("GPTQ bit packing").
    """
    ones = _ones_words(bits)
    col = torch.arange(qzeros.shape[1]) % ones.numel()
    return _i32((_u32(qzeros) + sign * ones[col]) & 0xFFFFFFFF)


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors < 0.18 packing: 32 // bits values per word, leftover bits unused
    ("compressed-tensors packing")."""
    pf = 32 // bits
    v = values.to(torch.int64)
    v = v.t() if dim == 0 else v
    rows, count = v.shape
    n = -(-count // pf)
    v = torch.nn.functional.pad(v, (0, n * pf - count)).reshape(rows, n, pf)
    words = _i32((v << (torch.arange(pf) * bits)).sum(-1))
    return words.t().contiguous() if dim == 0 else words.contiguous()


def unpack_words(words: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    pf = 32 // bits
    w = _u32(words)
    w = w.t() if dim == 0 else w
    v = ((w.unsqueeze(-1) >> (torch.arange(pf) * bits)) & ((1 << bits) - 1)).reshape(w.shape[0], -1)
    v = v[:, :count].to(torch.uint8)
    return v.t().contiguous() if dim == 0 else v.contiguous()


# ---- GPTQ ("GPTQ") ---------------------------------------------------------------------------------


def decode_gptq(prefix: str, get: Get, lq: LayerQuant) -> QuantizedWeight:
    qweight = _int_tensor(_need(get, prefix, "qweight"), f"{prefix}.qweight")
    qzeros = _int_tensor(_need(get, prefix, "qzeros"), f"{prefix}.qzeros")
    scales = _need(get, prefix, "scales")
    g_idx = get("g_idx")
    n, n_groups = qweight.shape[1], scales.shape[0]
    if scales.shape[1] != n:
        raise _error(
            f"{prefix}.scales", f"shape {list(scales.shape)} has {scales.shape[1]} columns, qweight N={n}"
        )
    bits, group = lq.bits, lq.group_size
    if g_idx is not None:
        if g_idx.dim() != 1:
            raise _error(f"{prefix}.g_idx", f"expected [K], got shape {list(g_idx.shape)}")
        k = g_idx.shape[0]
        if qweight.shape[0] * 32 != k * bits:
            derived = qweight.shape[0] * 32 / k if k else 0
            if not (lq.from_shapes and derived in SUPPORTED_BITS):
                raise _error(
                    f"{prefix}.qweight",
                    f"{qweight.shape[0]} rows over K = {k} (from g_idx) mean {derived:g} bits, config says {bits}",
                )
            bits = int(derived)
    else:
        k = qweight.shape[0] * 32 // bits
    _check_bits(f"{prefix}.qweight", bits)
    group = _group_from_shapes(f"{prefix}.scales", k, n_groups, group, lq.from_shapes)
    if tuple(qzeros.shape) != (n_groups, packed_len(n, bits)):
        raise _error(
            f"{prefix}.qzeros",
            f"shape {list(qzeros.shape)}, expected [{n_groups}, {packed_len(n, bits)}] for {bits}-bit N={n}",
        )
    q = unpack(qweight, bits, dim=0, count=k)
    fmt = lq.zero_format
    if fmt == "auto":
        raw = unpack(qzeros, bits, dim=1, count=n)
        fmt = "v2" if lq.sym and bool((raw == 1 << (bits - 1)).all()) else "v1"
    if fmt == "v2":
        zeros = unpack(qzeros, bits, dim=1, count=n)
    elif lq.sym:  # per slot; for symmetric zeros it agrees with the whole-word rule ("GPTQ zero points")
        zeros = (unpack(qzeros, bits, dim=1, count=n) + 1) & ((1 << bits) - 1)
    else:
        logger.warning(
            "%s: asymmetric GPTQ v1 zeros read with whole-word +1 (exact for GPTQModel exports); AutoGPTQ "
            "asymmetric v1 files may already be corrupt (docs/quantized-checkpoints.md, 'GPTQ zero points')",
            prefix,
        )
        zeros = unpack(v1_zero_words(qzeros, bits, +1), bits, dim=1, count=n)
    if lq.sym and not bool((zeros == 1 << (bits - 1)).all()):
        logger.warning("%s: config says sym but the stored zeros vary; using the stored zeros", prefix)
    gi = g_idx.to(torch.int32) if g_idx is not None else None
    return _finish(prefix, QuantizedWeight(q, scales, zeros, bits, group, gi))


# ---- AWQ ("AWQ") -----------------------------------------------------------------------------------


def decode_awq_gemm(prefix: str, get: Get, lq: LayerQuant) -> QuantizedWeight:
    qweight = _int_tensor(_need(get, prefix, "qweight"), f"{prefix}.qweight")
    qzeros = _int_tensor(_need(get, prefix, "qzeros"), f"{prefix}.qzeros")
    scales = _need(get, prefix, "scales")
    k, n, n_groups = qweight.shape[0], scales.shape[1], scales.shape[0]
    if qweight.shape[1] * 8 != n:
        raise _error(f"{prefix}.qweight", f"shape {list(qweight.shape)} needs N/8 = {n // 8} columns (N={n})")
    group = _group_from_shapes(f"{prefix}.scales", k, n_groups, lq.group_size, False)
    if tuple(qzeros.shape) != (n_groups, n // 8):
        raise _error(f"{prefix}.qzeros", f"shape {list(qzeros.shape)}, expected [{n_groups}, {n // 8}]")
    inv = torch.tensor(AWQ_INV)

    def deinterleave(words: torch.Tensor) -> torch.Tensor:
        u = unpack(words, 4, dim=1)
        return u.reshape(u.shape[0], -1, 8)[:, :, inv].reshape(u.shape[0], -1)

    return _finish(prefix, QuantizedWeight(deinterleave(qweight), scales, deinterleave(qzeros), 4, group))


def decode_awq_gemv(prefix: str, get: Get, lq: LayerQuant) -> QuantizedWeight:
    """GEMV keeps nn.Linear orientation, natural nibble order; zeros/scales are padded along groups
    ("AWQ GEMV and GEMV_FAST")."""
    qweight = _int_tensor(_need(get, prefix, "qweight"), f"{prefix}.qweight")
    qzeros = _int_tensor(_need(get, prefix, "qzeros"), f"{prefix}.qzeros")
    scales = _need(get, prefix, "scales")
    n, k = qweight.shape[0], qweight.shape[1] * 8
    g = grouping.n_groups(k, lq.group_size)
    if scales.shape[0] != n or scales.shape[1] < g or qzeros.shape[0] != n or qzeros.shape[1] * 8 < g:
        raise _error(
            f"{prefix}.scales",
            f"GEMV scales {list(scales.shape)} / qzeros {list(qzeros.shape)} cannot hold {g} groups of "
            f"{lq.group_size} over K = {k}, N = {n}",
        )
    q = unpack(qweight, 4, dim=1).t()
    zeros = unpack(qzeros, 4, dim=1, count=g).t()
    return _finish(prefix, QuantizedWeight(q, scales[:, :g].t().contiguous(), zeros, 4, lq.group_size))


# ---- compressed-tensors pack-quantized ("compressed-tensors") --------------------------------------


def decode_compressed_tensors(prefix: str, get: Get, lq: LayerQuant) -> QuantizedWeight:
    packed = _int_tensor(_need(get, prefix, "weight_packed"), f"{prefix}.weight_packed")
    scale = _need(get, prefix, "weight_scale")
    shape = get("weight_shape")
    bits = lq.bits
    _check_bits(f"{prefix}.weight_packed", bits)
    n = packed.shape[0]
    if shape is not None:
        if shape.numel() != 2 or int(shape.reshape(-1)[0]) != n:
            raise _error(
                f"{prefix}.weight_shape", f"{shape.tolist()} does not match weight_packed rows N={n}"
            )
        k = int(shape.reshape(-1)[1])
    else:
        k = packed.shape[1] * 32 // bits
    dense, word = packed_len(k, bits), -(-k // (32 // bits))
    packing = lq.packing
    if packing == "auto":
        packing = "dense" if packed.shape[1] == dense else "word"
    want = dense if packing == "dense" else word
    if packed.shape[1] != want:
        raise _error(
            f"{prefix}.weight_packed",
            f"shape {list(packed.shape)}: K = {k} at {bits} bits needs {want} words per row ({packing} packing)",
        )
    if scale.shape[0] != n:
        raise _error(
            f"{prefix}.weight_scale", f"shape {list(scale.shape)} has {scale.shape[0]} rows, N = {n}"
        )
    group = _group_from_shapes(f"{prefix}.weight_scale", k, scale.shape[1], lq.group_size, False)
    unpk = unpack if packing == "dense" else unpack_words
    q = unpk(packed, bits, 1, k).t()
    zeros = None
    zp = get("weight_zero_point")
    if zp is not None:
        zp = _int_tensor(zp, f"{prefix}.weight_zero_point")
        zrows = packed_len(n, bits) if packing == "dense" else -(-n // (32 // bits))
        if tuple(zp.shape) != (zrows, scale.shape[1]):
            raise _error(
                f"{prefix}.weight_zero_point", f"shape {list(zp.shape)}, expected [{zrows}, {scale.shape[1]}]"
            )
        # stored = signed + 2^(b-1): the unsigned zero QuantizedWeight holds ("compressed-tensors and GPTQ")
        zeros = unpk(zp, bits, 0, n).t()
    elif not lq.sym:
        raise _error(f"{prefix}.weight_zero_point", "missing although the scheme is asymmetric")
    g_idx = get("weight_g_idx")
    gi = g_idx.to(torch.int32) if g_idx is not None else None
    return _finish(prefix, QuantizedWeight(q, scale.t().contiguous(), zeros, bits, group, gi))


# ---- Marlin ("Marlin"; the layout is docs/marlin.md) -----------------------------------------------


def decode_marlin(prefix: str, get: Get, lq: LayerQuant) -> QuantizedWeight:
    """AutoGPTQ/candle-vllm `B`/`s`, plus our act-order (`g_idx` sorted, `perm`) and asymmetric (`zp`)."""
    from quantserve.kernels.marlin import MarlinWeight, from_marlin

    b = _int_tensor(_need(get, prefix, "B"), f"{prefix}.B")
    s = _need(get, prefix, "s")
    k, n = 16 * b.shape[0], s.shape[1]
    if n == 0 or (2 * b.shape[1]) % n or (2 * b.shape[1]) // n not in (4, 8):
        raise _error(
            f"{prefix}.B", f"shape {list(b.shape)} is not [K/16, N*bits/2] for N = {n} and 4 or 8 bits"
        )
    bits = 2 * b.shape[1] // n
    group = _group_from_shapes(f"{prefix}.s", k, s.shape[0], lq.group_size, False)
    g_idx, perm, zp = get("g_idx"), get("perm"), get("zp")
    if (g_idx is None) != (perm is None):
        raise _error(f"{prefix}.g_idx", "Marlin act-order needs both g_idx and perm")
    m = MarlinWeight(
        qweight=b,
        scales=s,
        zeros=_int_tensor(zp, f"{prefix}.zp") if zp is not None else None,
        g_idx=g_idx.to(torch.int32) if g_idx is not None else None,
        perm=perm.to(torch.int32) if perm is not None else None,
        bits=bits,
        group_size=group,
        K=k,
        N=n,
    )
    try:
        w = from_marlin(m)
    except QuantLayoutError as e:
        raise ModelFileError(f"{prefix}: {e}; re-export the checkpoint") from None
    return _finish(prefix, w)


# ---- FP8 ("FP8") ----------------------------------------------------------------------------------------


def decode_fp8(prefix: str, get: Get, lq: LayerQuant) -> Fp8Weight:
    """`weight` float8_e4m3fn [N, K] times `weight_scale_inv` (native FP8) or `weight_scale` (compressed-tensors):
    one scale, one per output row, or one per `lq.block` block."""
    name = f"{prefix}.weight"
    w = _need(get, prefix, "weight")
    if w.dtype != torch.float8_e4m3fn:
        raise _error(name, f"dtype {w.dtype}: FP8 weights are float8_e4m3fn (e4m3)")
    suffix = "weight_scale_inv" if get("weight_scale_inv") is not None else "weight_scale"
    s, scale_name = get(suffix), f"{prefix}.{suffix}"
    if s is None:
        raise _error(scale_name, "missing from the checkpoint", "download the missing shard or file")
    if not s.is_floating_point() or s.dtype.itemsize < 2:
        raise _error(scale_name, f"dtype {s.dtype}: FP8 weight scales are float32, bfloat16 or float16")
    n, k = w.shape
    if lq.block is not None:
        block = lq.block
    elif s.numel() == 1:
        block = (n, k)  # per tensor
    elif s.numel() == n and (s.dim() == 1 or s.shape[-1] == 1):
        block = (1, k)  # per output channel
    else:
        raise _error(
            scale_name, f"shape {list(s.shape)} is neither one scale nor one per row of {name} [{n}, {k}]"
        )
    grid = (-(-n // block[0]), -(-k // block[1]))
    if s.numel() != grid[0] * grid[1] or (s.dim() == 2 and tuple(s.shape) != grid):
        raise _error(
            scale_name,
            f"shape {list(s.shape)} does not match {name} [{n}, {k}] in blocks of {list(block)}: expected {list(grid)}",
        )
    return Fp8Weight(w, s.float().reshape(grid), block)  # a static input_scale is not applied (W8A16)


def decode_int8(prefix: str, get: Get, lq: LayerQuant) -> QuantizedWeight:
    """compressed-tensors int-quantized: `weight` int8 [N, K] times `weight_scale` [N, 1], [1] or [N, K/G]; held as
    QuantizedWeight's unsigned 8-bit codes (the value plus 128, its symmetric zero)."""
    w = _need(get, prefix, "weight")
    if w.dtype != torch.int8:
        raise _error(f"{prefix}.weight", f"dtype {w.dtype}: int-quantized 8-bit weights are int8")
    s = get("weight_scale")
    if s is None:
        raise _error(
            f"{prefix}.weight_scale", "missing from the checkpoint", "download the missing shard or file"
        )
    n, k = w.shape
    groups = (
        1 if s.numel() in (1, n) and (s.numel() == 1 or s.dim() == 1 or s.shape[-1] == 1) else s.shape[-1]
    )
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(n, 1)
    scales = s.reshape(n, groups).t().contiguous()  # [groups, N]
    if groups > 1 and k % groups:
        raise _error(f"{prefix}.weight_scale", f"{groups} groups do not divide K = {k}")
    q = (w.to(torch.int16) + 128).to(torch.uint8).t().contiguous()  # [K, N]
    return _finish(prefix, QuantizedWeight(q, scales, None, 8, -1 if groups == 1 else k // groups))


def decode_mxfp4(prefix: str, get: Get, lq: LayerQuant) -> Mxfp4Weight:
    """compressed-tensors MXFP4: `weight_packed` uint8 [N, K/2] and `weight_scale` uint8 [N, K/32], gpt-oss's bytes
    (kernels/mxfp4.py) one row at a time."""
    packed, scale = _need(get, prefix, "weight_packed"), _need(get, prefix, "weight_scale")
    n, half = packed.shape
    if (
        packed.dtype != torch.uint8
        or scale.dtype != torch.uint8
        or half % 16
        or tuple(scale.shape) != (n, half // 16)
    ):
        raise _error(
            f"{prefix}.weight_packed",
            f"{packed.dtype} {list(packed.shape)} with weight_scale {scale.dtype} {list(scale.shape)} is not MXFP4 "
            "(uint8 [N, K/2] and uint8 [N, K/32])",
        )
    return Mxfp4Weight(packed.reshape(n, half // 16, 16), scale)


def decode_nvfp4(prefix: str, get: Get, lq: LayerQuant) -> Nvfp4Weight:
    """compressed-tensors NVFP4: `weight_packed` uint8 [N, K/2], `weight_scale` float8_e4m3fn [N, K/16] and
    `weight_global_scale` [1] (kernels/nvfp4.py)."""
    packed, scale = _need(get, prefix, "weight_packed"), _need(get, prefix, "weight_scale")
    glob = get("weight_global_scale")
    n, half = packed.shape
    if (
        packed.dtype != torch.uint8
        or scale.dtype != torch.float8_e4m3fn
        or (2 * half) % 16
        or tuple(scale.shape) != (n, 2 * half // 16)
        or glob is None
        or glob.numel() != 1
    ):
        raise _error(
            f"{prefix}.weight_packed",
            f"{packed.dtype} {list(packed.shape)} with weight_scale {scale.dtype} {list(scale.shape)} and "
            f"{'no' if glob is None else glob.numel()} global scale is not NVFP4 (uint8 [N, K/2], float8_e4m3fn "
            "[N, K/16], one float)",
        )
    return Nvfp4Weight(packed, scale, glob.float().reshape(1))


@dataclass(frozen=True)
class Layout:
    """A per-linear tensor layout (a scheme's `layout()`): the tensor that marks a quantized linear, all tensors
    it owns, the decoder."""

    marker: str
    suffixes: tuple[str, ...]
    decode: Callable[[str, Get, LayerQuant], QuantizedWeight | Fp8Weight | Mxfp4Weight | Nvfp4Weight]
