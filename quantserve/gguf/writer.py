"""Write one GGUF from a dense HF checkpoint with gguf-py's writer, streaming one tensor at a time.

GGUFWriter buffers every tensor unless driven through its incremental API: all tensor infos first (names,
shapes, types, byte sizes, known from the headers and the type rules), then header, KV and tensor-info
sections, then `write_tensor_data` per tensor. Peak memory is the largest tensor in float32.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from tqdm import tqdm

from quantserve.errors import UnsupportedFormatError
from quantserve.gguf.archs import ArchSpec, language_model_name
from quantserve.gguf.native_quant import ggml_quantize
from quantserve.gguf.params import add_arch_params, llama3_rope_freqs
from quantserve.gguf.quant_types import QuantTarget, direct_tensor_type, n_bytes
from quantserve.gguf.safetensors_source import SafetensorsSource
from quantserve.gguf.tensor_math import qk_hf_rows_for_gguf
from quantserve.gguf.tokenizer import GGUFVocab

# HF buffers that are not weights (convert_hf_to_gguf.py skips the same suffixes)
_IGNORED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
_NUMPY_QUANTS = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
_FLOAT_FILES = (gguf.LlamaFileType.ALL_F32, gguf.LlamaFileType.MOSTLY_F16, gguf.LlamaFileType.MOSTLY_BF16)


@dataclass(frozen=True, eq=False)
class OutTensor:
    name: str  # GGUF name
    ne: tuple[int, ...]  # GGUF order (ne[0] = row length)
    qtype: T
    load: Callable[[], np.ndarray]  # float32 in numpy order, already permuted for llama.cpp

    @property
    def n_bytes(self) -> int:
        return n_bytes(self.qtype, self.ne)


def _loader(
    source: SafetensorsSource,
    hf_name: str,
    heads: int | None,
    shift: float,
    rows: int | None,
    transform: Callable[[np.ndarray, str], np.ndarray] | None = None,
) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        x = source.read(hf_name)
        if transform is not None:
            x = transform(x, source.tensors[hf_name].dtype)
        if rows is not None:
            x = x[:rows]
        if shift:
            x = _in_dtype(x + np.float32(shift), source.tensors[hf_name].dtype)
        # llama.cpp's LlamaModel.permute: rotate-half rows -> interleaved pairs
        # (docs/gguf.md, "Q/K permutation")
        return x if heads is None else x[qk_hf_rows_for_gguf(x.shape[0], heads)]

    return load


def _in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded as llama.cpp's converter rounds its arithmetic: in float16 for an F16 checkpoint,
    in float32 for the others (it widens BF16 first)."""
    return x.astype(np.float16).astype(np.float32) if dtype == "F16" else x


def plan_tensors(
    spec: ArchSpec, source: SafetensorsSource, hp: dict[str, Any], target: QuantTarget
) -> list[OutTensor]:
    """Every output tensor with its GGUF name, shape and type, in source order (rope_freqs first).

    Raises:
        UnsupportedFormatError: a source tensor this arch's map does not know.
    """
    n_head, n_kv = hp["num_attention_heads"], hp.get("num_key_value_heads") or hp["num_attention_heads"]
    text = {h: n for h in source.tensors if (n := language_model_name(h)) is not None}  # a LLaVA's LM only
    tied = "output.weight" not in {spec.gguf_name(n) for n in text.values() if n not in spec.skip_tensors}
    out: list[OutTensor] = []
    if (freqs := llama3_rope_freqs(hp)) is not None:
        out.append(OutTensor("rope_freqs.weight", freqs.shape, T.F32, lambda: freqs))
    for name, value in spec.extra_tensors(hp) if spec.extra_tensors else ():
        out.append(OutTensor(name, value.shape, T.F32, lambda value=value: value))
    experts = _Experts(spec, source, hp, target, tied)
    vocab_rows = spec.vocab_rows(source.directory) if spec.vocab_rows else None
    mxfp4 = _mxfp4_experts(spec, source)
    for hf_name, t in source.tensors.items():
        if hf_name.endswith(_IGNORED) or hf_name not in text or text[hf_name] in spec.skip_tensors:
            continue
        if text[hf_name].startswith(_MTP):  # a multi-token-prediction head: left out, as `--no-mtp` does
            continue
        if hf_name.endswith(_MXFP4_PARTS):  # written first (_mxfp4_experts)
            continue
        if (stacked := experts.add(text[hf_name], hf_name)) is not None:
            out += stacked
            continue
        if (parts := spec.stacked_parts(text[hf_name])) is not None:  # stacked by the checkpoint (gpt-oss)
            out += _split_stacked(source, hf_name, parts, target, tied)
            continue
        if spec.experts and (split := _packed_experts(spec, source, hf_name, text[hf_name], target, tied)):
            out += split
            continue
        name = spec.gguf_name(text[hf_name])
        if name is None:
            raise UnsupportedFormatError(
                f"{t.path.name}: tensor '{hf_name}' has no llama.cpp '{spec.gguf_arch}' equivalent; this variant "
                f"of {spec.hf_architecture} cannot be converted"
            )
        heads = None
        if spec.permute_qk and name.endswith((".attn_q.weight", ".attn_q.bias")):
            heads = n_head
        elif spec.permute_qk and name.endswith((".attn_k.weight", ".attn_k.bias")):
            heads = n_kv
        shape, rows = t.shape, None
        if name == "token_embd.weight" and vocab_rows is not None and vocab_rows < shape[0]:
            shape, rows = (vocab_rows, *shape[1:]), vocab_rows
        layer = m.group(1) if (m := _LAYER_SUFFIX.match(text[hf_name])) else ""
        shifted = text[hf_name].endswith("norm.weight") and not layer.endswith(
            spec.norm_shift_skip or ("\0",)
        )
        shift = spec.norm_shift if shifted else 0.0
        change = spec.transform(layer, shape, hp) if spec.transform is not None and layer else None
        if change is not None:
            shape = change[0]
        ne = tuple(reversed(shape))
        load = _loader(source, hf_name, heads, shift, rows, change[1] if change is not None else None)
        out.append(OutTensor(name, ne, direct_tensor_type(name, ne, target, tied), load))
    experts.check_complete()
    return mxfp4 + out


_MXFP4_PARTS = ("_blocks", "_scales")
_MTP = ("mtp.", "model.mtp.")
_LAYER_SUFFIX = re.compile(r"^model\.layers\.\d+\.(.+)$")


def _split_stacked(
    source: SafetensorsSource, hf_name: str, parts: tuple[tuple[str, slice], ...], target: QuantTarget, tied
) -> list[OutTensor]:
    """The GGUF tensors of one tensor stacked over the experts: a float weight [E, in, out] turned into a linear's
    [E, out, in], then each part's rows of `out`."""
    shape = source.tensors[hf_name].shape
    if len(shape) == 3:
        shape = (shape[0], shape[2], shape[1])
    found = []
    for name, rows in parts:
        n = len(range(shape[1])[rows])
        ne = tuple(reversed((shape[0], n, *shape[2:])))

        def load(rows: slice = rows) -> np.ndarray:
            x = source.read(hf_name)
            return (x.transpose(0, 2, 1) if x.ndim == 3 else x)[:, rows]

        found.append(OutTensor(name, ne, direct_tensor_type(name, ne, target, tied), load))
    return found


_PACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")


def _packed_experts(
    spec: ArchSpec, source: SafetensorsSource, hf_name: str, name: str, target: QuantTarget, tied
) -> list[OutTensor]:
    """A layer's experts as transformers 5 stacks them itself (the released Qwen3.5-MoE): `gate_up_proj`
    [E, 2 I, H] splits into its gate and up halves, `down_proj` [E, H, I] is written as it is, each under the
    arch's stacked expert name (convert_hf_to_gguf.py's Qwen2MoeModel.modify_tensors). [] for any other tensor."""
    m = _PACKED.match(name)
    shape = source.tensors[hf_name].shape
    if m is None or len(shape) != 3:
        return []
    names = dict(spec.experts)
    if m.group(2) == "down_proj":
        parts = [(names["down_proj.weight"], slice(None))]
    else:
        half = shape[1] // 2
        parts = [(names["gate_proj.weight"], slice(0, half)), (names["up_proj.weight"], slice(half, None))]
    found = []
    for suffix, rows in parts:
        gguf_name = f"blk.{m.group(1)}.{suffix}"
        ne = (shape[2], len(range(shape[1])[rows]), shape[0])

        def load(rows: slice = rows) -> np.ndarray:
            return np.ascontiguousarray(source.read(hf_name)[:, rows])

        found.append(OutTensor(gguf_name, ne, direct_tensor_type(gguf_name, ne, target, tied), load))
    return found


def _mxfp4_experts(spec: ArchSpec, source: SafetensorsSource) -> list[OutTensor]:
    """The checkpoint's MXFP4 expert weights as ggml MXFP4 tensors, in the order llama.cpp's converter writes them
    (each pair where its `_scales` comes in the file, before any other tensor)."""
    out = []
    for hf_name in source.tensors:
        if (
            not hf_name.endswith("_scales")
            or (parts := spec.stacked_parts(hf_name.removesuffix("_scales"))) is None
        ):
            continue
        blocks, scales = hf_name.removesuffix("_scales") + "_blocks", hf_name
        if blocks not in source.tensors:
            raise UnsupportedFormatError(
                f"the checkpoint has '{scales}' but not '{blocks}'; it is incomplete"
            )
        e, n, k_blocks, _ = source.tensors[blocks].shape
        for name, rows in parts:
            ne = (k_blocks * 32, len(range(n)[rows]), e)

            def load(rows: slice = rows, blocks: str = blocks, scales: str = scales) -> np.ndarray:
                return mxfp4_to_ggml(source.raw(blocks)[:, rows], source.raw(scales)[:, rows])

            out.append(OutTensor(name, ne, T.MXFP4, load))
    return out


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF's MXFP4 (blocks [..., K/32, 16]: byte j holds values 2j and 2j + 1 in its low and high nibbles; scales
    [..., K/32]) as ggml's block_mxfp4 rows [..., K/32 * 17]: each block's scale byte, then 16 bytes whose byte j
    holds values j and j + 16. The 4-bit codes and the e8m0 scale mean the same in both (kernels/mxfp4.py)."""
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate((scales[..., None], qs), axis=-1).reshape(*blocks.shape[:-2], -1).astype(np.uint8)


class _Experts:
    """Gathers each layer's expert tensors and, once the layer's last one is read, plans the tensors that stack
    them (where convert_hf_to_gguf.py writes them: at the layer's last expert tensor, in ArchSpec.experts order)."""

    def __init__(
        self, spec: ArchSpec, source: SafetensorsSource, hp: dict[str, Any], target: QuantTarget, tied
    ):
        self.spec, self.source, self.target, self.tied = spec, source, target, tied
        self.count = hp.get("num_local_experts") or hp.get("num_experts") or 0
        self.layers: dict[int, dict[tuple[str, int], str]] = {}

    def add(self, name: str, hf_name: str) -> list[OutTensor] | None:
        """None for a tensor that is no expert's; else the stacked tensors now complete (maybe none yet)."""
        found = self.spec.expert_of(name)
        if found is None:
            return None
        layer, expert, gguf_name = found
        if expert >= self.count:
            raise UnsupportedFormatError(
                f"tensor '{hf_name}' is expert {expert}, but config.json has {self.count} experts "
                "(num_experts / num_local_experts); the checkpoint and its config disagree"
            )
        got = self.layers.setdefault(layer, {})
        got[(gguf_name, expert)] = hf_name
        if len(got) < self.count * len(self.spec.experts):
            return []
        del self.layers[layer]
        out = []
        for _, suffix in self.spec.experts:
            stacked = f"blk.{layer}.{suffix}"
            names = [got[(stacked, e)] for e in range(self.count)]
            shape = self.source.tensors[names[0]].shape
            if any(self.source.tensors[n].shape != shape for n in names):
                raise UnsupportedFormatError(
                    f"the experts of '{stacked}' differ in shape; they cannot be stacked"
                )
            ne = (*reversed(shape), self.count)
            qtype = direct_tensor_type(stacked, ne, self.target, self.tied)
            out.append(OutTensor(stacked, ne, qtype, self._stack(names)))
        return out

    def _stack(self, names: list[str]) -> Callable[[], np.ndarray]:
        return lambda: np.stack([self.source.read(n) for n in names])

    def check_complete(self) -> None:
        """Raises UnsupportedFormatError naming the first expert tensor a layer lacks."""
        for layer, got in self.layers.items():
            for _, suffix in self.spec.experts:
                for e in range(self.count):
                    if (f"blk.{layer}.{suffix}", e) not in got:
                        hf = {g: h for h, g in self.spec.experts}[suffix]
                        raise UnsupportedFormatError(
                            f"the checkpoint lacks 'model.layers.{layer}.{self.spec.expert_prefix}.{e}.{hf}' ({self.count} "
                            "experts in config.json); it is incomplete or its config is wrong"
                        )


def _encode(x: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.MXFP4:  # the checkpoint's own blocks, already in ggml's layout
        return x
    if qtype in _NUMPY_QUANTS:
        return gguf.quants.quantize(x, qtype)  # bit-exact with ggml for these types (gguf-py's own tests)
    return ggml_quantize(x.reshape(-1, x.shape[-1]), qtype).reshape(*x.shape[:-1], -1)


def _metadata(writer: gguf.GGUFWriter, model_dir: Path) -> gguf.Metadata:
    """general.* from the model card, config and generation_config heuristics, as convert_hf_to_gguf.py fills them."""
    total, shared, expert, count = writer.get_total_parameter_count()
    meta = gguf.Metadata.load(None, model_dir, None, total)
    meta.name = meta.name or model_dir.name
    meta.size_label = meta.size_label or gguf.size_label(total, shared, expert, count)
    return meta


def default_file_name(tensors: list[OutTensor], model_dir: Path, target: QuantTarget) -> str:
    """convert_hf_to_gguf.py's name for its output in a directory, e.g. `SmolLM2-135M-Instruct-135M-F16.gguf`."""
    writer = gguf.GGUFWriter(path=None, arch="")
    for t in tensors:
        writer.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), 0, raw_dtype=t.qtype)
    m = _metadata(writer, model_dir)
    output_type = target.ftype.name.partition("_")[2]  # as llama.cpp: MOSTLY_Q4_K_M -> Q4_K_M
    return (
        f"{gguf.naming_convention(m.name, m.basename, m.finetune, m.version, m.size_label, output_type)}.gguf"
    )


def write_gguf(
    path: Path,
    spec: ArchSpec,
    hp: dict[str, Any],
    tensors: list[OutTensor],
    vocab: GGUFVocab,
    target: QuantTarget,
    model_dir: Path,
    progress: bool,
) -> None:
    """Write the GGUF file at `path` (KV order as convert_hf_to_gguf.py: general.*, arch keys, tokenizer)."""
    writer = gguf.GGUFWriter(path=None, arch=spec.gguf_arch)
    for t in tensors:
        writer.add_tensor_info(
            t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype
        )
    spec.first_keys(writer, hp)
    writer.add_type(gguf.GGUFType.MODEL)
    _metadata(writer, model_dir).set_gguf_meta_model(writer)
    ftype = target.ftype
    if any(t.qtype == T.MXFP4 for t in tensors) and ftype in _FLOAT_FILES:  # as llama.cpp's converter says it
        ftype = gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    add_arch_params(writer, spec, hp, int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if not spec.llama_kv and not vocab.space_prefix_last:  # only LlamaModel reads tokenizer_config's own
        vocab = replace(vocab, add_space_prefix=None)
    vocab.add_to(writer)
    bos_key = gguf.Keys.Tokenizer.ADD_BOS
    if (
        spec.llama_kv
        and hp.get("vocab_size") == 49152
        and getattr(writer.kv_data[0].get(bos_key), "value", None) is not False
    ):
        writer.add_add_bos_token(False)  # LlamaModel.set_vocab's "granite small models" rule (SmolLM too)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tqdm(tensors, desc=f"write {target.name}", unit="tensor", disable=not progress):
        writer.write_tensor_data(_encode(t.load(), t.qtype))
    writer.close()
