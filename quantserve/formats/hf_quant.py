"""HF safetensors checkpoints: parse the quantization config per method and verify it against tensor shapes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from quantserve.errors import ModelFileError, UnsupportedFormatError
from quantserve.formats.hf_config import find_quant_config, quant_method_of
from quantserve.formats.safetensors_header import FLOAT_DTYPES
from quantserve.formats.spec import SafetensorsTensor

Tensors = Mapping[str, SafetensorsTensor]
# (quantization config, where it came from, tensors) -> (format, spec.quant)
QuantMethod = Callable[[dict[str, Any], str, Tensors], tuple[str, dict[str, Any]]]
QUANT_METHODS: dict[str, QuantMethod] = {}

# The tensor suffix that marks a quantized linear, and the fingerprint it must have, per §6.3 of FORMATS.md.
_LABELS = {
    "gptq": "GPTQ",
    "awq-gemm": "AWQ GEMM",
    "awq-gemv": "AWQ GEMV",
    "awq-gemv_fast": "AWQ GEMV_FAST",
    "awq-marlin": "AWQ Marlin",
    "marlin": "Marlin (B/s)",
    "compressed-tensors": "compressed-tensors",
    "unknown": "unrecognised",
}
QUANT_SUFFIXES = ("qweight", "B", "weight_packed")


def register(*names: str) -> Callable[[QuantMethod], QuantMethod]:
    """Register a parser for `quant_method` values; a new scheme is one new function here, no elif."""

    def wrap(fn: QuantMethod) -> QuantMethod:
        for name in names:
            QUANT_METHODS[name] = fn
        return fn

    return wrap


def fingerprint(prefix: str, t: Tensors) -> str:
    """Which layout a quantized linear's tensors have, from shapes and dtypes alone (FORMATS.md §6.3)."""

    def get(suffix: str) -> SafetensorsTensor | None:
        x = t.get(f"{prefix}.{suffix}")
        return x if x is not None and len(x.shape) == 2 else None

    if (b := get("B")) is not None and (s := get("s")) is not None:
        # B is [K/16, N*bits/2]: 2N for 4-bit, 4N for 8-bit (vLLM's gptq_marlin layout, FORMATS §3.2)
        return "marlin" if b.shape[1] in (2 * s.shape[1], 4 * s.shape[1]) else "unknown"
    if f"{prefix}.weight_packed" in t:
        return "compressed-tensors"
    qw, sc, qz = get("qweight"), get("scales"), t.get(f"{prefix}.qzeros")
    if qw is None or sc is None:
        return "unknown"
    if qw.dtype == "I16" or (qz is not None and qz.dtype in FLOAT_DTYPES):
        return "awq-gemv_fast"
    if qw.shape[1] == sc.shape[1]:
        return "gptq"  # qweight [K*b/32, N], scales [K/G, N]
    if 8 * qw.shape[1] == sc.shape[1]:
        return "awq-gemm"  # qweight [K, N/8], scales [K/G, N]
    if qw.shape[1] == 2 * sc.shape[1]:
        return "awq-marlin"  # qweight [K/16, 2N]
    if qw.shape[0] == sc.shape[0]:
        return "awq-gemv"  # qweight [N, K/8], scales [N, 8*Wz]
    return "unknown"


def quantized_prefixes(t: Tensors, suffix: str) -> list[str]:
    tail = "." + suffix
    return sorted(name[: -len(tail)] for name in t if name.endswith(tail))


def describe_layer(prefix: str, t: Tensors) -> str:
    parts = [
        f"{n[len(prefix) + 1 :]} {x.dtype} {list(x.shape)}"
        for n, x in sorted(t.items())
        if n.startswith(prefix + ".")
    ]
    return f"'{prefix}' ({', '.join(parts)})"


def any_quantized_layer(t: Tensors) -> tuple[str, str] | None:
    """(prefix, fingerprint) of the first quantized-looking linear, whatever its format."""
    for suffix in QUANT_SUFFIXES:
        for prefix in quantized_prefixes(t, suffix):
            return prefix, fingerprint(prefix, t)
    return None


def _int(qc: dict[str, Any], keys: tuple[str, ...], default: int | None, where: str) -> int:
    for key in keys:
        if qc.get(key) is not None:
            try:
                return int(qc[key])
            except (TypeError, ValueError):
                raise ModelFileError(f"{where}: {key} = {qc[key]!r} is not an integer") from None
    if default is None:
        raise ModelFileError(f"{where}: missing '{keys[0]}'; add it to the quantization config")
    return default


def _n_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-k // group_size)


def _layers(t: Tensors, suffix: str, method: str, where: str) -> list[str]:
    prefixes = quantized_prefixes(t, suffix)
    if prefixes:
        return prefixes
    found = any_quantized_layer(t)
    seen = (
        f"{_LABELS[found[1]]}-shaped {describe_layer(found[0], t)}" if found else "only unquantized tensors"
    )
    raise ModelFileError(
        f"{where} says quant_method '{method}' but no '*.{suffix}' tensors exist; found {seen}. "
        "Fix the quantization config or re-download the checkpoint"
    )


def _expect(prefix: str, t: Tensors, want: str, method: str, where: str) -> None:
    got = fingerprint(prefix, t)
    if got != want:
        raise ModelFileError(
            f"{where} says quant_method '{method}' ({_LABELS[want]} layout) but {describe_layer(prefix, t)} is "
            f"{_LABELS[got]}-shaped; the config does not match the tensors — fix the config or re-download"
        )


def _mismatch(where: str, key: str, value: Any, prefix: str, t: Tensors, implied: str) -> ModelFileError:
    return ModelFileError(
        f"{where} says {key} {value} but {describe_layer(prefix, t)} implies {implied}; "
        "fix the quantization config or re-download the checkpoint"
    )


@register("gptq")
def parse_gptq(qc: dict[str, Any], where: str, t: Tensors) -> tuple[str, dict[str, Any]]:
    ckpt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if ckpt == "marlin" or qc.get("is_marlin_format"):
        return parse_marlin(qc, where, t)
    if ckpt not in ("gptq", "gptq_v2"):
        raise UnsupportedFormatError(
            f"{where}: GPTQ checkpoint_format '{ckpt}' is not supported (only gptq and gptq_v2); "
            "export the model with GPTQModel format='gptq'"
        )
    if str(qc.get("pack_dtype", "int32")).lower() != "int32":
        raise UnsupportedFormatError(
            f"{where}: GPTQ pack_dtype {qc['pack_dtype']!r} is not supported (only int32)"
        )
    bits, group = (
        _int(qc, ("bits", "w_bit"), None, where),
        _int(qc, ("group_size", "q_group_size"), -1, where),
    )
    if bits not in (2, 3, 4, 8) or group == 0 or group < -1:
        raise UnsupportedFormatError(
            f"{where}: GPTQ bits {bits} / group_size {group} unsupported (bits 2/3/4/8)"
        )
    sym = not qc["zero_point"] if "zero_point" in qc and "sym" not in qc else bool(qc.get("sym", True))
    quant = {"bits": bits, "group_size": group, "sym": sym, "desc_act": bool(qc.get("desc_act", False))}
    quant["checkpoint_format"] = ckpt
    per_module = bool(qc.get("dynamic"))  # GPTQModel overrides bits/group per module: check layouts only
    for prefix in _layers(t, "qweight", "gptq", where):
        _expect(prefix, t, "gptq", "gptq", where)
        qw, sc, gi = t[prefix + ".qweight"], t[prefix + ".scales"], t.get(prefix + ".g_idx")
        if gi is None or per_module or len(gi.shape) != 1 or gi.shape[0] == 0:
            continue
        k = gi.shape[0]
        if qw.shape[0] * 32 != k * bits:
            raise _mismatch(where, "bits", bits, prefix, t, f"{qw.shape[0] * 32 / k:g} bits (K = {k})")
        if sc.shape[0] != _n_groups(k, group):
            raise _mismatch(where, "group_size", group, prefix, t, f"{sc.shape[0]} groups over K = {k}")
    return "gptq", quant


@register("marlin")
def parse_marlin(qc: dict[str, Any], where: str, t: Tensors) -> tuple[str, dict[str, Any]]:
    bits, group = _int(qc, ("bits", "w_bit"), 4, where), _int(qc, ("group_size", "q_group_size"), 128, where)
    # IST-DASLab/AutoGPTQ Marlin is 4-bit, groups 128/-1; vLLM's layout (which quantserve writes) adds 8-bit and
    # groups 32/64.
    if bits not in (4, 8) or group not in (-1, 32, 64, 128):
        raise UnsupportedFormatError(
            f"{where}: Marlin checkpoints are 4- or 8-bit with group_size 32, 64, 128 or -1, got bits {bits} "
            f"group_size {group}"
        )
    for prefix in _layers(t, "B", "marlin", where):
        _expect(prefix, t, "marlin", "marlin", where)
        b, s = t[prefix + ".B"], t[prefix + ".s"]
        if b.shape[1] * 2 != s.shape[1] * bits:
            raise _mismatch(where, "bits", bits, prefix, t, f"{2 * b.shape[1] // s.shape[1]}-bit")
        if s.shape[0] != _n_groups(16 * b.shape[0], group):
            raise _mismatch(
                where, "group_size", group, prefix, t, f"{s.shape[0]} groups over K = {16 * b.shape[0]}"
            )
    return "marlin", {"bits": bits, "group_size": group}


_AWQ_LAYOUTS = {"gemm": "awq-gemm", "exllama": "awq-gemm", "ipex": "awq-gemm", "gemv": "awq-gemv"}
_AWQ_LAYOUTS |= {"gemv_fast": "awq-gemv_fast", "marlin": "awq-marlin"}


@register("awq")
def parse_awq(qc: dict[str, Any], where: str, t: Tensors) -> tuple[str, dict[str, Any]]:
    bits, group = _int(qc, ("bits", "w_bit"), 4, where), _int(qc, ("group_size", "q_group_size"), 128, where)
    version = str(qc.get("version") or "gemm").lower()
    if version not in _AWQ_LAYOUTS:
        raise UnsupportedFormatError(
            f"{where}: AWQ version '{version}' is unknown (known: {', '.join(_AWQ_LAYOUTS)})"
        )
    if bits != 4 or group == 0 or group < -1:
        raise UnsupportedFormatError(
            f"{where}: AWQ bits {bits} / group_size {group} unsupported (AWQ is 4-bit)"
        )
    want = _AWQ_LAYOUTS[version]
    for prefix in _layers(t, "qweight", "awq", where):
        _expect(prefix, t, want, "awq", where)
        qw, sc = t[prefix + ".qweight"], t[prefix + ".scales"]
        if want == "awq-gemm" and sc.shape[0] != _n_groups(qw.shape[0], group):
            raise _mismatch(
                where, "group_size", group, prefix, t, f"{sc.shape[0]} groups over K = {qw.shape[0]}"
            )
    quant = {
        "bits": bits,
        "group_size": group,
        "zero_point": bool(qc.get("zero_point", True)),
        "version": version,
    }
    return "awq", quant


_ACTORDER = {None: None, False: None, True: "group", "group": "group", "dynamic": "group"}
_ACTORDER |= {"weight": "weight", "static": "weight"}


@register("compressed-tensors")
def parse_compressed_tensors(qc: dict[str, Any], where: str, t: Tensors) -> tuple[str, dict[str, Any]]:
    groups = qc.get("config_groups")
    schemes = [g for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    schemes = [g for g in schemes if isinstance(g.get("weights"), dict)]
    if not schemes:
        raise ModelFileError(
            f"{where}: compressed-tensors config has no config_groups with 'weights' arguments"
        )
    scheme = schemes[0]
    w = scheme["weights"]
    fmt = str(scheme.get("format") or qc.get("format") or "")
    if fmt != "pack-quantized" or w.get("type", "int") != "int":
        raise UnsupportedFormatError(
            f"{where}: compressed-tensors format '{fmt}' with {w.get('type', 'int')} weights is not supported "
            "(only pack-quantized int weights, e.g. W4A16); re-export with llm-compressor's W4A16 scheme"
        )
    actorder = w.get("actorder")
    quant = {
        "format": fmt,
        "num_bits": _int(w, ("num_bits",), None, where),
        "group_size": w.get("group_size"),
        "symmetric": bool(w.get("symmetric", True)),
        "strategy": str(w.get("strategy") or "tensor"),
        "actorder": _ACTORDER.get(actorder.lower() if isinstance(actorder, str) else actorder, actorder)
        if isinstance(actorder, str | bool | None)
        else str(actorder),
    }
    bits, group = quant["num_bits"], quant["group_size"]
    if not 1 <= bits <= 8:
        raise UnsupportedFormatError(
            f"{where}: compressed-tensors num_bits {bits} unsupported (int weights are 1-8 bit)"
        )
    for prefix in _layers(t, "weight_packed", "compressed-tensors", where):
        packed, scale = t[prefix + ".weight_packed"], t.get(prefix + ".weight_scale")
        if packed.dtype != "I32" or len(packed.shape) != 2 or scale is None or len(scale.shape) != 2:
            raise ModelFileError(
                f"{where}: {describe_layer(prefix, t)} needs I32 2-D weight_packed and weight_scale"
            )
        if scale.shape[0] != packed.shape[0]:
            raise _mismatch(where, "format", fmt, prefix, t, "weight_scale rows != weight_packed rows (N)")
        if not quant["symmetric"] and prefix + ".weight_zero_point" not in t:
            raise _mismatch(where, "symmetric", False, prefix, t, "a symmetric layer (no weight_zero_point)")
        if len(schemes) == 1 and quant["strategy"] == "group" and isinstance(group, int) and group > 0:
            # K lies in the range the packed width allows, under either packing rule of §5.2 (whole values per
            # word before compressed-tensors 0.18, a dense bitstream after; the same for 1/2/4/8 bits).
            cols, pf = packed.shape[1], 32 // bits
            k_max = max(cols * 32 // bits, cols * pf)
            k_min = min((cols - 1) * 32 // bits + 1, (cols - 1) * pf + 1)
            lo, hi = _n_groups(max(k_min, 1), group), _n_groups(k_max, group)
            if not lo <= scale.shape[1] <= hi:
                raise _mismatch(where, "num_bits/group_size", f"{bits}/{group}", prefix, t, f"K ≈ {k_max}")
    return "compressed-tensors", quant


def detect_hf(
    config: dict[str, Any] | None, directory: Path, t: Tensors, st_metadata: Mapping[str, str]
) -> tuple[str, dict[str, Any]]:
    """Format and spec.quant of a safetensors checkpoint from its configs and tensor table."""
    qc, where = find_quant_config(config, directory, st_metadata)
    if qc is not None:
        method = quant_method_of(qc)
        parser = QUANT_METHODS.get(method)
        if parser is None:
            raise UnsupportedFormatError(
                f"{where} has quant_method '{method or '(missing)'}', which quantserve does not "
                f"support (supported: {', '.join(sorted(QUANT_METHODS))}); use a GPTQ/AWQ/GGUF build of the model"
            )
        return parser(qc, where, t)
    found = any_quantized_layer(t)
    if found:
        raise ModelFileError(
            f"{directory}: {describe_layer(found[0], t)} is {_LABELS[found[1]]}-quantized but there is no "
            "quantization config (config.json quantization_config, quantize_config.json or quant_config.json); "
            "add the config from the original repository"
        )
    dtypes: dict[str, int] = {}
    for x in t.values():
        if len(x.shape) >= 2:
            dtypes[x.dtype] = dtypes.get(x.dtype, 0) + 1
    dtype = max(dtypes, key=dtypes.__getitem__) if dtypes else None
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedFormatError(
            f"{directory}: unquantized weights must be F16, BF16 or F32 but the matrices are {dtypes or 'absent'} "
            "and there is no quantization config; convert the checkpoint to fp16/bf16 safetensors"
        )
    return "safetensors", {"dtype": FLOAT_DTYPES[dtype]}
