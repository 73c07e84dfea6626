"""Layer-by-layer quantization driver: stream a dense HF checkpoint one decoder layer at a time through RTN,
GPTQ or AWQ, yielding every quantized linear and the tensors that stay dense.

Memory: one decoder layer (float32, on `device`; a hybrid's two kinds of layer share one MLP) plus the calibration
activations [n_samples, seq_len, hidden] (and, for AWQ, the inputs of that layer's linears). Layer i+1 is calibrated on layer i's outputs computed with
layer i's *quantized* weights, as GPTQ's reference llama.py does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from quantserve.backends.torch.model import ModelArgs, RotaryEmbedding, TransformerBlock
from quantserve.converters.calibration.awq_block import quantize_block_awq, quantize_block_awq_gptq
from quantserve.converters.calibration.layers import (
    LayerResult,
    QuantizeOptions,
    block_linears,
    quantize_block_gptq,
    quantize_block_rtn,
    run_block,
)
from quantserve.errors import ConfigError, ModelFileError
from quantserve.formats import detect
from quantserve.kernels.qweight import QuantizedWeight

log = logging.getLogger(__name__)

# The per-layer step of each method (layers.METHODS names them). Register, don't elif: a new method is one more
# entry.
LAYER_METHODS: dict[str, Callable[..., LayerResult]] = {
    "rtn": quantize_block_rtn,
    "gptq": quantize_block_gptq,
    "awq": quantize_block_awq,
    "awq-gptq": quantize_block_awq_gptq,
}

DEFAULT_N_SAMPLES = 128  # AutoAWQ's default; the built-in text gives fewer (see split_tokens)
DEFAULT_SEQ_LEN = 512
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@dataclass(frozen=True)
class QuantizedLinear:
    """A quantized linear; `prefix` is its name without `.weight` (model.layers.3.mlp.up_proj)."""

    prefix: str
    weight: QuantizedWeight  # on the CPU
    bias: torch.Tensor | None  # [N] in the checkpoint's dtype (qwen2 q/k/v; AWQ may have rescaled v's)
    loss: float | None = None  # GPTQ: ‖(W − Ŵ) X‖² per calibration token


@dataclass(frozen=True)
class DenseTensor:
    """A tensor left unquantized (embeddings, norms (AWQ-rescaled), lm_head), in the checkpoint's dtype."""

    name: str
    tensor: torch.Tensor


class SafetensorsReader:
    """The tensors of a dense checkpoint by name, each read on request from safetensors' memory map. `rename`
    (ModelArgs.our_name) gives each the name quantserve's model uses (Mixtral's `block_sparse_moe.experts.E.w1`
    is `mlp.experts.E.gate_proj`): tensors are asked for by those names, and `their_name` gives the
    checkpoint's back, for the output. Experts stacked in one tensor per layer (transformers 5's layout, as the
    released Qwen3.5-MoE ships) are read one expert at a time, and written out apart (the torch backend's
    SafetensorsFiles)."""

    def __init__(self, files: tuple[Path, ...] | list[Path], rename: Callable[[str], str] | None = None):
        from quantserve.backends.torch.weights import SafetensorsFiles

        self._files = SafetensorsFiles(tuple(files))
        stacked = self._files.stacked()
        where = [n for n in self._files.names() if n not in stacked]
        self._theirs = {(rename(n) if rename else n): n for n in where}  # ours -> the checkpoint's
        if len(self._theirs) < len(where):
            seen: dict[str, str] = {}
            for n in where:
                if (ours := rename(n) if rename else n) in seen:
                    raise ModelFileError(
                        f"the checkpoint has both '{seen[ours]}' and '{n}', which are one tensor"
                    )
                seen[ours] = n

    def names(self) -> set[str]:
        return set(self._theirs)

    def __contains__(self, name: str) -> bool:
        return name in self._theirs

    def get(self, name: str) -> torch.Tensor:
        if name not in self._theirs:
            raise ModelFileError(f"the checkpoint has no tensor '{name}'; is it complete?")
        return self._files.read(self._theirs[name])

    def their_name(self, name: str) -> str:
        """The checkpoint's name of one of ours (a tensor, or a linear's prefix)."""
        if name in self._theirs:
            return self._theirs[name]
        return self._theirs.get(name + ".weight", name + ".weight").removesuffix(".weight")


def default_calibration_text() -> str:
    """The built-in calibration text (quantserve/data/calib.txt; deliberately not the evaluation text)."""
    return (resources.files("quantserve") / "data" / "calib.txt").read_text(encoding="utf-8")


def split_tokens(
    ids: list[int], n_samples: int = DEFAULT_N_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN
) -> torch.Tensor:
    """Consecutive, non-overlapping windows: int64 [n, T] with T = min(seq_len, len(ids)) and
    n = min(n_samples, len(ids) // T). A short text gives fewer samples rather than repeated ones.

    Raises:
        ConfigError: fewer than 16 tokens.
    """
    if len(ids) < 16:
        raise ConfigError(f"the calibration text has only {len(ids)} tokens; pass a longer --calib file")
    t = min(seq_len, len(ids))
    n = max(1, min(n_samples, len(ids) // t))
    return torch.tensor(ids[: n * t], dtype=torch.long).reshape(n, t)


def calibration_tokens(
    src_dir: str | Path,
    text: str | None = None,
    n_samples: int = DEFAULT_N_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> torch.Tensor:
    """Tokenize `text` (default: the built-in calibration text) with the model's tokenizer.json; [n, T]."""
    from tokenizers import Tokenizer

    path = Path(src_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{src_dir} has no tokenizer.json to tokenize the calibration text; pass token ids")
    tok = Tokenizer.from_file(str(path))
    text = default_calibration_text() if text is None else text
    return split_tokens(tok.encode(text, add_special_tokens=False).ids, n_samples, seq_len)


def quantize_model(
    src_dir: str | Path,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    act_order: bool = False,
    calib_tokens: torch.Tensor | None = None,
    *,
    damp_percent: float = 0.01,
    static_groups: bool = False,
    true_sequential: bool = True,
    duo_scaling: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    device: str | torch.device | None = None,
    batch_size: int = 8,
    overrides: dict[str, tuple[int, int]] | None = None,
    progress: bool = True,
    deltanet: bool = False,
) -> Iterator[QuantizedLinear | DenseTensor]:
    """Quantize every decoder linear of a dense checkpoint of a family the torch model runs, one layer at a time
    (Qwen3.5's Gated DeltaNet projections only with `deltanet`; layers.py says which).

    Args:
        src_dir: HF model directory (config.json + fp16/bf16/fp32 safetensors).
        method: "rtn", "gptq", "awq" (AWQ: sym=False is AutoAWQ's zero_point=True; act_order must be off) or
            "awq-gptq" (AWQ's scales, then GPTQ's rounding).
        overrides: (bits, group_size) for some linears by prefix (model.layers.28.mlp.down_proj), the rest
            take `bits`/`group_size`: a mixed-precision recipe (recipes.py).
        calib_tokens: int64 [n_samples, seq_len]; None: the built-in text through the model's tokenizer
            (calibration_tokens). Ignored by rtn.
        batch_size: calibration samples per forward call.
        device: where layers and activations live; default cuda when available.

    Returns:
        An iterator of QuantizedLinear (every q/k/v/o/gate/up/down of every layer) and DenseTensor
        (embeddings, per-layer norms, final norm, untied lm_head), layer by layer, all on the CPU. Checks
        run now; the work happens as it is consumed.

    Raises:
        ConfigError: bad options, K not a multiple of group_size, an already-quantized checkpoint.
        UnsupportedFormatError: an architecture the torch model does not implement.
    """
    spec = detect(src_dir)
    if spec.format != "safetensors" or not spec.config:
        raise ConfigError(
            f"{src_dir} is a {spec.format} model; quantize a dense fp16/bf16/fp32 safetensors checkpoint "
            "with its config.json"
        )
    args = ModelArgs.from_hf_config(spec.config)
    opt = QuantizeOptions(
        method, bits, group_size, sym, act_order, damp_percent, static_groups, true_sequential, duo_scaling,
        scale_dtype, batch_size, tuple(sorted((overrides or {}).items())), deltanet=deltanet,
    )  # fmt: skip
    opt.check(args)
    if opt.calibrated:
        if calib_tokens is None:
            calib_tokens = calibration_tokens(src_dir)
        if calib_tokens.dim() != 2 or calib_tokens.numel() == 0:
            raise ConfigError(f"calib_tokens must be [n_samples, seq_len]; got {list(calib_tokens.shape)}")
        if int(calib_tokens.min()) < 0 or int(calib_tokens.max()) >= args.vocab_size:
            raise ConfigError(
                f"calibration token ids must lie in [0, {args.vocab_size}) (the model's vocabulary)"
            )
    else:
        calib_tokens = None
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    return _stream(SafetensorsReader(spec.files, args.our_name), args, calib_tokens, opt, dev, progress)


def ropes(args: ModelArgs, n: int, device: torch.device | str) -> tuple[Any, Any]:
    """The rotary tables of n positions for the global layers and for the windowed ones (Gemma 3's local base;
    the same table for every other model), each computed once."""
    rope = RotaryEmbedding(args).to(device)(torch.arange(n, device=device), n - 1)
    if not args.rope_local_theta:
        return rope, rope
    local_args = replace(args, rope_theta=args.rope_local_theta, rope_scaling=())
    return rope, RotaryEmbedding(local_args).to(device)(torch.arange(n, device=device), n - 1)


@torch.no_grad()
def _stream(
    reader: SafetensorsReader,
    args: ModelArgs,
    tokens: torch.Tensor | None,
    opt: QuantizeOptions,
    device: torch.device,
    progress: bool,
) -> Iterator[QuantizedLinear | DenseTensor]:
    used = {EMBED, FINAL_NORM, LM_HEAD}
    embed = reader.get(EMBED)
    yield DenseTensor(reader.their_name(EMBED), embed)
    hidden = rope = local = None
    if tokens is not None:
        hidden = torch.nn.functional.embedding(tokens.to(device), embed.to(device, torch.float32))
        if args.embed_scale:  # Gemma
            hidden *= args.hidden_size**0.5
        rope, local = ropes(args, tokens.shape[1], device)
    del embed
    blocks: dict[str, tuple[TransformerBlock, dict[str, torch.Tensor], tuple[str, ...]]] = {}
    n_layers = args.num_hidden_layers
    bar = tqdm(range(n_layers), desc=f"quantize ({opt.method})", unit="layer", disable=not progress)
    for i in bar:
        start = time.perf_counter()
        prefix = f"model.layers.{i}."
        # one block serves every layer of a kind (Qwen3.5: a DeltaNet one and an attention one)
        kind = args.layer_types[i] if args.layer_types else ""
        if kind not in blocks:  # (the kinds share one MLP: a mixture's experts are held once)
            shared = next(iter(blocks.values()))[0].mlp if blocks else None
            block = empty_block(args, device, i, deltanet=opt.deltanet, mlp=shared)
            blocks[kind] = block, block.state_dict(), block_linears(block)
        block, state, linears = blocks[kind]
        dtypes = load_layer(reader, state, i, args.norm_offset)
        norms = {n: p.clone() for n, p in state.items() if args.norm_offset and shifted(n)}
        used.update(prefix + name for name in state)
        window = args.layer_windows[i] if args.layer_windows else 0
        if not block.linear:
            block.self_attn.window = window  # its window is the layer's
        layer_rope = local if window else rope
        results = LAYER_METHODS[opt.method](
            block, hidden, layer_rope if hidden is not None else None, replace(opt, layer=i)
        )
        kept = {n for n, p in norms.items() if torch.equal(p, state[n])}  # Gemma norms AWQ did not rescale
        for name, p in state.items():  # dense tensors as they will be stored (AWQ changed norms and v's bias)
            if name.removesuffix(".weight") not in linears and name not in kept:
                off = args.norm_offset if shifted(name) else 0.0  # Gemma's stored w of 1 + w
                p.copy_((p - off).to(dtypes[name]).float() + off)
        if hidden is not None and i + 1 < n_layers:
            run_block(block, hidden, layer_rope, opt.batch_size, out=hidden)
        elapsed = time.perf_counter() - start
        losses = [r[1] for r in results.values() if r[1] is not None]
        bar.set_postfix_str(f"layer {i + 1}/{n_layers} · {opt.method} · {elapsed:.1f} s")
        log.info(
            "layer %d/%d · %s · %.1f s%s", i + 1, n_layers, opt.method, elapsed,
            f" · mean GPTQ loss {sum(losses) / len(losses):.4g}" if losses else "",
        )  # fmt: skip
        for name, p in state.items():
            module = name.rsplit(".", 1)[0]
            if module in linears:
                if name.endswith(".weight"):
                    bias = state.get(module + ".bias")
                    qw, loss = results[module]
                    b = None if bias is None else bias.to("cpu", dtypes[module + ".bias"], copy=True)
                    yield QuantizedLinear(reader.their_name(prefix + module), _to_cpu(qw), b, loss)
            elif args.norm_offset and shifted(name):  # Gemma's norm as stored (w, not 1 + w)
                # the checkpoint's own bytes unless AWQ rescaled it ((1 + w) - 1 may round in float32)
                w = (
                    reader.get(prefix + name)
                    if name in kept
                    else (p - args.norm_offset).to("cpu", dtypes[name])
                )
                yield DenseTensor(reader.their_name(prefix + name), w)
            else:
                yield DenseTensor(reader.their_name(prefix + name), p.to("cpu", dtypes[name], copy=True))
    del blocks, hidden
    yield DenseTensor(reader.their_name(FINAL_NORM), reader.get(FINAL_NORM))
    if LM_HEAD in reader and not args.tie_word_embeddings:
        yield DenseTensor(reader.their_name(LM_HEAD), reader.get(LM_HEAD))
    unused = sorted(n for n in reader.names() - used if not n.endswith("rotary_emb.inv_freq"))
    if args.wrapped:  # a multimodal checkpoint's vision tower and projector, carried over as they are
        for name in unused:
            yield DenseTensor(reader.their_name(name), reader.get(name))
    elif unused:
        log.warning("tensors not part of the quantized model were dropped: %s", ", ".join(unused[:8]))


def load_layer(
    reader: SafetensorsReader, state: dict[str, torch.Tensor], i: int, norm_offset: float = 0.0
) -> dict[str, torch.dtype]:
    """Copy decoder layer i's tensors into a block's state dict (as float32); returns their stored dtypes.
    `norm_offset` is added to the norms' weights (Gemma's (1 + w), as the torch backend loads them).

    Raises:
        ModelFileError: a tensor is missing or its shape differs from what config.json implies.
    """
    dtypes = {}
    for name, dst in state.items():
        src = reader.get(f"model.layers.{i}.{name}")
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelFileError(
                f"model.layers.{i}.{name}: shape {list(src.shape)}, config implies {list(dst.shape)}"
            )
        dst.copy_(src.float() + norm_offset if norm_offset and shifted(name) else src)
        dtypes[name] = src.dtype
    return dtypes


def shifted(name: str) -> bool:
    """A norm whose weight the model holds as 1 + w where the model has such norms (Gemma, Qwen3.5); a DeltaNet's
    gated norm scales by w itself."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def empty_block(
    args: ModelArgs,
    device: torch.device,
    layer: int = 0,
    *,
    deltanet: bool = False,
    mlp: torch.nn.Module | None = None,
) -> TransformerBlock:
    """A float32 decoder block on `device` for layer `layer`'s kind, reused for every layer of that kind (no random
    init of weights that get overwritten). A mixture of experts runs every expert on every token while it
    calibrates, so that each gets a Hessian however the router sends the calibration tokens (llm-compressor's
    moe_calibrate_all_experts). `deltanet`: a DeltaNet block's own projections are quantized too. `mlp`: another
    block's MLP to share (Qwen3.5's DeltaNet and attention layers have the same one), not allocated again."""
    with torch.device("meta"):
        block = TransformerBlock(args, layer)
    if mlp is not None:
        block.mlp = torch.nn.Identity()
    elif args.num_experts:
        block.mlp.calibrate_all = True
    block.quantize_deltanet = deltanet and block.linear
    block = block.to_empty(device=device).float().eval()
    if mlp is not None:
        block.mlp = mlp
    return block


def _to_cpu(w: QuantizedWeight) -> QuantizedWeight:
    return replace(
        w,
        qweight=w.qweight.cpu(),
        scales=w.scales.cpu(),
        zeros=None if w.zeros is None else w.zeros.cpu(),
        g_idx=None if w.g_idx is None else w.g_idx.cpu(),
    )
