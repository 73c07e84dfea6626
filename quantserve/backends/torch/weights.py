"""Build the torch model from a checkpoint: dense weights copied in, quantized linears repacked to Marlin once.

Dense fp16/bf16/fp32 safetensors load as is, or are quantized at load (`--quant int4`: RTN, 4-bit, symmetric, then
the Marlin layout). GPTQ, AWQ, compressed-tensors and Marlin checkpoints are read into the canonical form by
quantserve.formats and repacked to Marlin (vLLM's layout) for the W4A16 kernels.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from quantserve.backends.torch import llava
from quantserve.backends.torch.archs import LOAD_QUANTS
from quantserve.backends.torch.deltanet import QUANTIZABLE
from quantserve.backends.torch.model import ModelArgs, RotaryEmbedding, Transformer, empty_embedding
from quantserve.backends.torch.tp_shard import Shards, TensorParallel, local_args
from quantserve.errors import ConfigError, ModelFileError, UnsupportedFormatError
from quantserve.formats import ModelSpec
from quantserve.formats.hf_config import is_llava

log = logging.getLogger("quantserve.torch")


def _empty_model(
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    drop: list[str] | tuple[str, ...] = (),
    vocab_rows: int = 0,
) -> Transformer:
    """A model with uninitialised parameters in `dtype` (no time spent on random init), rotary tables computed.
    The linears in `drop` (quantized ones, replaced by QuantLinear right after) get no dense storage: an
    nn.Identity holds their place until then. `vocab_rows`: a tensor-parallel rank's rows of the embedding and
    output layer (0: the whole vocabulary)."""
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
        if vocab_rows:
            model.model.embed_tokens = empty_embedding(vocab_rows, args.hidden_size, dtype=dtype)
            model.lm_head = nn.Linear(args.hidden_size, vocab_rows, bias=False, dtype=dtype)
        for prefix in drop:
            _set_module(model, prefix, nn.Identity())
    model = model.to_empty(device=device)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.__init__(m.args)
            m.to(device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ModelFileError(
            f"tensor {name} has shape {list(value.shape)} but config.json implies {list(param.shape)}; "
            "the checkpoint and its config do not match"
        )
    with torch.no_grad():
        param.copy_(value)


def _fill_dense(
    model: Transformer, names: set[str], read: Callable[[str], torch.Tensor], skip: set[str]
) -> None:
    """Copy every dense tensor the model has from the checkpoint (`read(name)`); complain about what is missing."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.args.tie_word_embeddings or "lm_head.weight" not in names:
        params.pop("lm_head.weight", None)
        if "lm_head.weight" not in names and not model.args.tie_word_embeddings:
            # a missing tie_word_embeddings defaults differ per class; the file decides
            # (docs/quantized-checkpoints.md, "Detection pitfalls").
            log.info("no lm_head.weight in the checkpoint: the output layer shares the embeddings")
            model.lm_head.weight = model.model.embed_tokens.weight
    wanted = {n: p for n, p in params.items() if n not in skip}
    missing = [n for n in wanted if n not in names]
    if missing:
        raise ModelFileError(
            f"the checkpoint lacks {len(missing)} tensors the {model.args.arch} model needs, e.g. {missing[:3]}; "
            "is it a complete checkpoint of this architecture?"
        )
    offset = model.args.norm_offset  # Gemma's norms scale by (1 + w): stored as 1 + w, the sum in fp32
    for n, p in wanted.items():
        value = read(n)
        # (a DeltaNet's gated norm scales by w itself)
        shifted = offset and n.endswith("norm.weight") and not n.endswith("linear_attn.norm.weight")
        _copy(p, value.float() + offset if shifted else value, n)


class SafetensorsFiles:
    """Tensors by name across (sharded) safetensors files, read through safetensors' memory map (no pickle).

    A mixture of experts saved in transformers 5's own layout stacks a layer's experts in two tensors,
    `mlp.experts.gate_up_proj` [E, 2 I, H] (gate in the first half of the rows) and `mlp.experts.down_proj`
    [E, H, I] (how the released Qwen3.5-MoE checkpoints ship): each expert's gate_proj, up_proj and down_proj are
    read from them as if stored apart, only that expert's rows."""

    def __init__(self, files: tuple[Path, ...]):
        self._handles = [safe_open(str(p), framework="pt") for p in files]
        self.where = {n: h for h in self._handles for n in h.keys()}  # noqa: SIM118 - safe_open has keys()
        # per-expert name -> (the stacked tensor's name, the expert, its rows)
        self.unpacked: dict[str, tuple[str, int, slice]] = {}
        for n, h in self.where.items():
            m = _PACKED_EXPERTS.match(n)
            shape = h.get_slice(n).get_shape() if m else []
            if not m or len(shape) != 3:
                continue
            base, kind = m.group(1), m.group(2)
            half = shape[1] // 2
            parts = {"gate_proj": slice(0, half), "up_proj": slice(half, None)} if kind == "gate_up_proj" else {
                "down_proj": slice(None)}  # fmt: skip
            for e in range(shape[0]):
                for part, rows in parts.items():
                    self.unpacked[f"{base}.{e}.{part}.weight"] = (n, e, rows)

    def names(self) -> list[str]:
        return [*self.where, *(n for n in self.unpacked if n not in self.where)]

    def stacked(self) -> set[str]:
        """The stacked tensors that `unpacked` reads experts from."""
        return {packed for packed, _, _ in self.unpacked.values()}

    def read(self, name: str) -> torch.Tensor:
        if name not in self.where and name in self.unpacked:
            packed, e, rows = self.unpacked[name]
            return self.where[packed].get_slice(packed)[e, rows]
        return self.where[name].get_tensor(name)

    def lazy(self, name: str):
        """The tensor as a slice object: indexing it reads only those rows or columns (a tensor-parallel rank's)."""
        if name not in self.where and name in self.unpacked:
            return self.read(name)  # one expert's matrix, already small
        return self.where[name].get_slice(name)


_PACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$")


def _set_module(model: nn.Module, prefix: str, module: nn.Module) -> None:
    parent, _, child = prefix.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def decoder_linears(model: Transformer) -> list[str]:
    """Prefixes of the linears inside decoder layers (what GPTQ/AWQ quantize; lm_head and MoE routers stay
    dense; gpt-oss's experts are not linears: they keep the checkpoint's own MXFP4 or float weights)."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and n.startswith("model.layers.")
        and not n.endswith((".mlp.gate", ".mlp.router", ".mlp.shared_expert_gate"))
        and ".linear_attn."
        not in n  # Qwen3.5's DeltaNets stay in the model's dtype, as its recipes keep them
    ]


def load_model(
    spec: ModelSpec,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quant: str | None = None,
    tp: TensorParallel | None = None,
) -> Transformer:
    """The model for `spec` (dense or quantized safetensors) on `device`; with `tp`, this rank's slice of it
    (backends/torch/tp_shard.py).

    Raises:
        ModelFileError: tensors missing or of the wrong shape.
        ConfigError: `quant` is not something the torch backend applies at load; a model that does not split
            over tp.world ranks (the dimension named).
    """
    t0 = time.perf_counter()
    config = spec.config or {}
    if is_llava(config):  # its language model, named as in a plain checkpoint (the vision side: llava.py)
        args, name = ModelArgs.from_hf_config(llava.text_config(config)), llava.rename
    else:
        args = ModelArgs.from_hf_config(config)
        name = args.our_name
    if args.swiglu and spec.scheme is not None:
        raise UnsupportedFormatError(
            f"{spec.path} is a {spec.scheme.label}-quantized gpt-oss; the torch backend reads gpt-oss as released "
            "(MXFP4 experts) or in bf16/fp16/fp32"
        )
    if (spec.quant or {}).get("experts") == "mxfp4":  # wherever its quantization config was found
        args = replace(args, packed_experts=True)
    shards = Shards(args, tp.rank, tp.world) if tp is not None else None
    if shards is not None:
        args = local_args(args, shards.world, shards.rank)
    vocab_rows = shards.vocab_rows(args.vocab_size) if shards is not None else 0

    def cut(n: str, t: torch.Tensor) -> torch.Tensor:
        return t if shards is None else shards.dense(n, t)

    if quant and spec.scheme is not None:
        raise ConfigError(
            f"{spec.path} is already {spec.format}-quantized; drop --quant {quant}", param="quant"
        )
    if quant and quant.lower() not in LOAD_QUANTS:
        raise ConfigError(
            f"--quant {quant} is a GGUF type; the torch backend quantizes at load to "
            f"{', '.join(LOAD_QUANTS)} (or serve with --backend llamacpp)",
            param="quant",
        )
    if spec.scheme is not None:
        from quantserve.backends.torch.float_linear import Fp8Linear, Mxfp4Linear, Nvfp4Linear
        from quantserve.backends.torch.quant_linear import QuantLinear
        from quantserve.formats.quant_read import open_quantized
        from quantserve.kernels.fp8 import Fp8Weight
        from quantserve.kernels.mxfp4 import Mxfp4Weight
        from quantserve.kernels.nvfp4 import Nvfp4Weight

        with open_quantized(spec) as ckpt:
            prefixes = {name(p): p for p in ckpt.linear_prefixes()}  # ours -> the checkpoint's
            if outside := [p for p in prefixes if not p.startswith(("model.layers.", "lm_head", "vision_tower.",
                                                                    "multi_modal_projector."))]:  # fmt: skip
                raise UnsupportedFormatError(
                    f"{spec.path} quantizes linears outside the language model ({outside[0]}, …), which the torch "
                    "backend runs in full precision only; quantize the language model alone"
                )
            if narrow := [p for p in prefixes if ".linear_attn." in p and not p.endswith(QUANTIZABLE)]:
                raise UnsupportedFormatError(
                    f"{spec.path} quantizes a Gated DeltaNet's {narrow[0].rsplit('.', 1)[-1]} ({narrow[0]}), one output "
                    "per value head, which the torch backend runs in full precision only; quantize the DeltaNet's "
                    f"{', '.join(QUANTIZABLE)} alone (quantserve convert --quantize-deltanet does)"
                )
            if vision := [p for p in prefixes if llava.is_vision(p)]:
                raise UnsupportedFormatError(
                    f"{spec.path} quantizes the vision side ({vision[0]}, …); the torch backend runs the vision "
                    "tower and projector in full precision only. Quantize the language model alone."
                )
            model = _empty_model(args, dtype, device, drop=list(prefixes), vocab_rows=vocab_rows)
            floats = spec.scheme.float_weights  # FP8, MXFP4, NVFP4: kept as they ship, decoded in the matmul
            if floats and shards is not None:
                raise ConfigError(
                    f"{spec.path} is {spec.scheme.label}, which the torch backend serves on one device for now; drop "
                    "--tensor-parallel-size, or serve it with --backend llamacpp",
                    param="tensor_parallel_size",
                )
            desc = f"read {spec.scheme.label}" if floats else "repack to Marlin"
            for prefix, theirs in tqdm(prefixes.items(), desc=desc, unit="linear", leave=False):
                qw, bias = ckpt.read_linear(theirs), ckpt.read_bias(theirs)
                if isinstance(qw, Fp8Weight | Mxfp4Weight | Nvfp4Weight):
                    cls = {Fp8Weight: Fp8Linear, Mxfp4Weight: Mxfp4Linear, Nvfp4Weight: Nvfp4Linear}[type(qw)]
                    _set_module(model, prefix, cls(qw, bias, dtype=dtype, device=device, name=prefix))
                    continue
                if shards is not None:
                    qw = shards.quantized(prefix, qw)
                    bias = None if bias is None else shards.dense(prefix + ".bias", bias)
                layer = QuantLinear.from_quantized(qw, bias, dtype=dtype, device=device, name=prefix)
                _set_module(model, prefix, layer)
            params = dict(model.named_parameters(remove_duplicate=False))
            skip = {n for n in params if n.rsplit(".", 1)[0] in prefixes}
            dense = {name(n): n for n in ckpt.dense_names()}
            _fill_dense(model, set(dense), lambda n: cut(n, ckpt.read_dense(dense[n])), skip)
    elif spec.format == "safetensors":
        model = _empty_model(args, dtype, device, vocab_rows=vocab_rows)
        files = SafetensorsFiles(spec.files)
        dense = {name(n): n for n in files.names()}
        if shards is None:
            _fill_dense(model, set(dense), lambda n: files.read(dense[n]), skip=set())
        else:  # a rank reads only its slice of each tensor
            _fill_dense(model, set(dense), lambda n: shards.dense(n, files.lazy(dense[n])), skip=set())
        if quant:
            _quantize_in_place(model, dtype, device, shards)
    else:
        raise ConfigError(f"the torch backend cannot serve {spec.format} files; use --backend llamacpp")
    model.eval()
    if tp is not None:
        model.tp = tp
        for layer in model.model.layers:
            layer.tp = tp
    log.info(
        "torch model %s (%s, %d layers) loaded on %s as %s in %.1fs",
        spec.path,
        args.arch,
        args.num_hidden_layers,
        device,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - t0,
    )
    return model


def _quantize_in_place(
    model: Transformer, dtype: torch.dtype, device: torch.device, shards: Shards | None = None
) -> None:
    """--quant int4: RTN 4-bit symmetric per group (128, or 64 / -1 where K needs it), then Marlin. A
    tensor-parallel slice gets the whole layer's group size, so that it quantizes exactly as one rank would."""
    from quantserve.backends.torch.quant_linear import QuantLinear
    from quantserve.quant.rtn import quantize_rtn

    for prefix in tqdm(decoder_linears(model), desc="quantize int4 (RTN)", unit="linear", leave=False):
        lin = model.get_submodule(prefix)
        k = lin.in_features
        row = shards is not None and shards.kind(prefix) == "row"
        whole = k * shards.world if row else k
        group = next((g for g in (128, 64, 32) if whole % g == 0), -1)
        if row and (group == -1 or k % group):
            raise ConfigError(
                f"{prefix}: its K = {whole} input features split over {shards.world} ranks are {k} each, not a "
                f"multiple of the int4 group size {group}; use a --tensor-parallel-size that keeps whole groups",
                param="tensor_parallel_size",
            )
        qw = quantize_rtn(lin.weight.detach().float(), bits=4, group_size=group, sym=True)
        bias = lin.bias.detach() if lin.bias is not None else None
        _set_module(
            model, prefix, QuantLinear.from_quantized(qw, bias, dtype=dtype, device=device, name=prefix)
        )
