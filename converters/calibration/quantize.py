"""HF checkpoint → GPTQ/AWQ/compressed-tensors/Marlin directory: quantize a dense model, or repack a quantized one.

The library side of `quantserve convert --quant gptq|awq|rtn` and `--format`: the layer-by-layer quantizer
(driver.py) or a quantized checkpoint's reader feeds the format writers (hf_quant) one linear at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quantserve.converters.calibration.layers import METHODS
from quantserve.converters.hf_quant import WriteOptions, write_quantized, writers
from quantserve.errors import ConfigError, UnsupportedFormatError
from quantserve.formats import ModelSpec, detect, read_safetensors_header
from quantserve.formats.schemes import QuantScheme, schemes

log = logging.getLogger("quantserve.convert")

DEFAULT_FORMAT = {"rtn": "gptq", "gptq": "gptq", "awq": "awq", "awq-gptq": "gptq"}
ACT_ORDERS = ("off", "static", "group")


@dataclass(frozen=True)
class QuantizeReport:
    path: Path
    method: str
    format: str
    n_linears: int
    seconds: float
    mean_loss: float | None  # GPTQ: mean ‖(W − Ŵ) X‖² per token over the linears
    calibration: str | None = None  # where the calibration tokens came from, and how many
    overrides: dict[str, tuple[int, int]] | None = None  # --bits-budget: linears raised, (bits, group_size)
    # bits per weight of the quantized linears, as the GPTQ format stores them
    linear_bpw: float | None = None


def quantize_checkpoint(
    src: Path,
    dst: Path,
    method: str,
    *,
    fmt: str | None = None,
    bits: int = 4,
    group_size: int = 128,
    sym: bool | None = None,
    act_order: str | None = None,
    calib: str | None = None,
    calib_dataset: str | None = None,
    n_samples: int | None = None,
    seq_len: int | None = None,
    damp_percent: float = 0.01,
    bits_budget: float | None = None,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    calib_tokens: torch.Tensor | None = None,
    deltanet: bool = False,
) -> QuantizeReport:
    """Quantize the dense checkpoint `src` with `method` and write it to `dst` in `fmt`.

    `sym` None means the method's usual choice: symmetric for RTN and GPTQ (what Marlin serves), asymmetric
    (zero points) for AWQ. `act_order` (GPTQ): "static" processes columns in order of decreasing activation
    energy but keeps groups contiguous (a trivial g_idx, so Marlin's fast path applies), "group" forms groups in
    that order too (a permuted g_idx), "off" is plain GPTQ; None means "static", which measured best on SmolLM2
    (bench/results/quant-quality.md: plain GPTQ overfits a small calibration set and loses to RTN there).
    "awq-gptq" is AWQ's scales followed by GPTQ's rounding (symmetric unless asked otherwise, like GPTQ).

    calib: "builtin" (default), "self" or a text file; calib_dataset: a Hugging Face dataset instead
    (sources.calibration_set). calib_tokens: ready-made int64 [n, T] ids, overriding both (benchmarks).
    bits_budget: raise the linears whose rounding costs the most KL per bit to 8 bits until the quantized
    linears average this many bits per weight (recipes.py); the format must state per-module bits (gptq).
    deltanet: quantize Qwen3.5's Gated DeltaNet projections too (in_proj_qkv, in_proj_z, out_proj); by default
    they stay in the checkpoint's dtype, as the published Qwen3.5 recipes keep them.

    Raises:
        ConfigError: an unknown method or format, a group size that does not divide a layer's K, options a
            format cannot hold (e.g. AWQ with act-order), or dst exists without force.
    """
    from quantserve.converters.calibration.driver import (
        DEFAULT_N_SAMPLES,
        DEFAULT_SEQ_LEN,
        DenseTensor,
        QuantizedLinear,
        quantize_model,
    )
    from quantserve.converters.calibration.recipes import linear_bpw, linear_shapes, plan_budget, sensitivity
    from quantserve.converters.calibration.sources import calibration_set

    if method not in METHODS:
        raise ConfigError(
            f"unknown quantization method '{method}' (known: {', '.join(METHODS)})", param="quant"
        )
    fmt = fmt or DEFAULT_FORMAT[method]
    target = _target(fmt)
    if sym is None:
        sym = method != "awq"
    act_order = act_order or ("static" if method in ("gptq", "awq-gptq") else "off")
    if act_order not in ACT_ORDERS:
        raise ConfigError(f"--act-order must be one of {', '.join(ACT_ORDERS)}", param="act_order")
    if bits_budget is not None and not writers()[fmt].per_module:
        raise ConfigError(
            f"--bits-budget needs a format that states bits per module (gptq); {fmt} states them once",
            param="bits_budget",
        )
    if act_order != "off" and method not in ("gptq", "awq-gptq"):
        raise ConfigError(f"--act-order applies to gptq, not {method}", param="act_order")
    if (why := target.cannot_hold(bits, group_size, act_order == "group")) is not None:
        raise ConfigError(f"--format {fmt}: {why}; choose another --format", param="format")
    spec = detect(src)
    if deltanet and spec.config:  # before any calibration work
        from quantserve.backends.torch.model import ModelArgs

        if not ModelArgs.from_hf_config(spec.config).deltanet:
            raise ConfigError(
                f"--quantize-deltanet applies to models with Gated DeltaNet layers (Qwen3.5); {src} has none",
                param="quantize_deltanet",
            )
    if (spec.config or {}).get("model_type") == "gpt_oss":
        raise UnsupportedFormatError(
            f"{src} is gpt-oss, which `convert --quant {method}` does not quantize (its experts are not linears, "
            "and they ship as MXFP4 already); serve it as it is with --backend torch, or convert it to GGUF"
        )
    if bits_budget is not None and spec.config:  # before any calibration work
        from quantserve.backends.torch.model import ModelArgs

        shapes = linear_shapes(ModelArgs.from_hf_config(spec.config), deltanet).values()
        base = sum(linear_bpw(n, k, bits, group_size) * n * k for n, k in shapes) / sum(
            n * k for n, k in shapes
        )
        if bits_budget < base:
            raise ConfigError(
                f"--bits-budget {bits_budget} is below {base:.3f}, the size of {bits}-bit group {group_size} "
                "itself; raise it, or take a larger --group-size or fewer --bits",
                param="bits_budget",
            )
    t0 = time.perf_counter()
    tokens, source = calib_tokens, "given tokens"
    if tokens is None and (method != "rtn" or bits_budget is not None):
        c = calibration_set(
            src, calib, dataset=calib_dataset, n_samples=n_samples or DEFAULT_N_SAMPLES,
            seq_len=seq_len or DEFAULT_SEQ_LEN, seed=seed, progress=progress,
        )  # fmt: skip
        tokens, source = c.tokens, c.source
    described = None if tokens is None else f"{source}: {tokens.shape[0]} x {tokens.shape[1]} tokens"
    if described:
        log.info("calibration: %s", described)
    overrides = None
    if bits_budget is not None:
        assert tokens is not None
        sens = sensitivity(src, tokens, bits, group_size, sym, deltanet=deltanet, progress=progress)
        plan = plan_budget(sens, bits, group_size, bits_budget)
        overrides = plan.overrides
        top = sorted(sens.kl, key=sens.kl.get, reverse=True)[:3]
        log.info(
            "sensitivity (%.0f s): most sensitive %s; %d linears at 8 bits, %.3f bits/weight over the linears",
            sens.seconds, ", ".join(f"{p} (KL {sens.kl[p]:.4f})" for p in top), len(overrides), plan.bpw,
        )  # fmt: skip
    stream = quantize_model(
        src, method, bits, group_size, sym, act_order != "off", tokens if method != "rtn" else None,
        damp_percent=damp_percent, static_groups=act_order == "static", overrides=overrides, progress=progress,
        deltanet=deltanet,
    )  # fmt: skip
    dense: list[tuple[str, torch.Tensor]] = []
    losses: list[float] = []
    count = [0]
    bits_sum = [0.0, 0]  # Σ bits, Σ weights over the quantized linears

    def layers() -> Iterator[tuple[str, object, torch.Tensor | None]]:
        for item in stream:
            if isinstance(item, QuantizedLinear):
                if item.loss is not None:
                    losses.append(item.loss)
                count[0] += 1
                w = item.weight
                bits_sum[0] += linear_bpw(w.N, w.K, w.bits, w.group_size) * w.N * w.K
                bits_sum[1] += w.N * w.K
                yield item.prefix, item.weight, item.bias
            elif isinstance(item, DenseTensor):
                dense.append((item.name, item.tensor))  # written after the linears; small next to them

    def dense_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from dense

    options = WriteOptions(
        modules_to_not_convert=_other_linears(spec) + _dense_deltanet(spec, deltanet),
        damp_percent=damp_percent if "gptq" in method else None,
        quantizer=f"quantserve:{method}",
        force=force,
        act_order=act_order == "group" if fmt == "compressed-tensors" else None,
        static_groups=act_order == "static",
    )
    out = write_quantized(
        dst, fmt, layers(), dense_tensors(), spec.config or {}, spec.directory, options=options
    )
    return QuantizeReport(
        out, method, fmt, count[0], time.perf_counter() - t0, sum(losses) / len(losses) if losses else None,
        described, overrides, bits_sum[0] / bits_sum[1] if bits_sum[1] else None,
    )  # fmt: skip


def _other_linears(spec: ModelSpec) -> tuple[str, ...]:
    """A multimodal checkpoint's linears outside its language model (the vision tower's, the projector's): left
    dense, and named so in the quantization config, so that no loader looks for their quantized tensors."""
    from quantserve.backends.torch.args import ModelArgs

    try:
        if not spec.config or not ModelArgs.from_hf_config(spec.config).wrapped:
            return ()
    except UnsupportedFormatError:  # a LLaVA: its language model is read as its own later
        return ()
    names = [t for f in spec.files for t in read_safetensors_header(f).tensors.values()]
    return tuple(
        sorted(
            t.name.removesuffix(".weight")
            for t in names
            if len(t.shape) == 2 and t.name.endswith(".weight") and "language_model." not in t.name
        )
    )


def _dense_deltanet(spec: ModelSpec, quantized: bool) -> tuple[str, ...]:
    """The Gated DeltaNet linears written dense (all of them, or in_proj_a and in_proj_b when the rest are
    quantized), named in the quantization config so that no loader looks for their quantized tensors. vLLM fuses
    them (in_proj_qkvz, in_proj_ba) and matches its skip rules against the fused names: those are named too."""
    from quantserve.converters.calibration.layers import DELTANET_LINEARS

    names = [t for f in spec.files for t in read_safetensors_header(f).tensors.values()]
    dense = {
        t.name.removesuffix(".weight") for t in names
        if len(t.shape) == 2 and ".linear_attn." in t.name and t.name.endswith(".weight")
        and not (quantized and t.name.removesuffix(".weight").endswith(DELTANET_LINEARS))
    }  # fmt: skip
    layers = {n.rpartition(".")[0] for n in dense}  # model.layers.0.linear_attn
    fused = {f"{x}.in_proj_ba" for x in layers} | (
        set() if quantized else {f"{x}.in_proj_qkvz" for x in layers}
    )
    return tuple(sorted(dense | fused))


def _target(fmt: str) -> type[QuantScheme]:
    known = schemes()
    if fmt not in known:
        raise ConfigError(
            f"unknown output format '{fmt}' (known: {', '.join(sorted(known))})", param="format"
        )
    return known[fmt]


def repack_checkpoint(src: Path, dst: Path, fmt: str, *, force: bool = False) -> Path:
    """Rewrite a GPTQ/AWQ/compressed-tensors/Marlin checkpoint in `fmt`, losslessly (same integers and scales).

    Raises:
        ConfigError: the source is not quantized, or `fmt` cannot hold its weights (e.g. AWQ from
            symmetric act-order GPTQ); the writer's message names the layer.
    """
    from quantserve.formats.quant_read import open_quantized

    target = _target(fmt)
    spec = detect(src)
    if spec.scheme is None:
        raise ConfigError(
            f"{src} is {spec.format}; --format repacks quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, "
            "Marlin). To quantize a dense one pass --quant gptq|awq|rtn"
        )
    if fmt not in spec.scheme.repack_targets():
        why = target.cannot_hold(*spec.scheme.weights()) or (
            "its weights are floating point, which no integer layout holds; serve it as it is, or convert it to "
            "GGUF with --quant q8_0"
        )
        raise ConfigError(
            f"{src} ({spec.scheme.summary()}) cannot be written as {fmt}: {why}", param="format"
        )
    with open_quantized(spec) as ck:
        layers = ((p, ck.read_linear(p), ck.read_bias(p, drop_zero=True)) for p in ck.linear_prefixes())
        dense = ((n, ck.read_dense(n)) for n in ck.dense_names())
        return write_quantized(
            dst, fmt, layers, dense, spec.config or {}, spec.directory, options=WriteOptions(force=force)
        )
