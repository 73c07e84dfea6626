"""The architecture registry: per-arch tensor-name maps and config rules, shared by both conversion directions,
and which of them the torch backend's own model runs.

An architecture is one ArchSpec in its own file in this package, listed in archs() below: a new family is its file
plus one line there. Nothing here branches on names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from quantserve.errors import UnsupportedFormatError
from quantserve.formats.hf_config import is_llava

# Outside the layers, identical for every registered arch (docs/gguf.md, "Tensor names").
GLOBAL_TENSORS = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
)
# Inside layer N: "model.layers.N." + HF suffix <-> "blk.N." + GGUF suffix.
DENSE_LAYER = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
)
# A mixture-of-experts layer: the router, and each expert's MLP, which llama.cpp stacks over the experts into one
# 3-D tensor per projection (convert_hf_to_gguf.py Qwen2MoeModel.modify_tensors), in this order.
ROUTER = (("mlp.gate.weight", "ffn_gate_inp.weight"),)
EXPERTS = (
    ("down_proj.weight", "ffn_down_exps.weight"),
    ("gate_proj.weight", "ffn_gate_exps.weight"),
    ("up_proj.weight", "ffn_up_exps.weight"),
)
QKV_BIAS = (
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
)
# A LLaVA checkpoint's vision tower and projector (they go to the mmproj file, quantserve.gguf.mmproj), and
# Qwen3.5's vision tower (no mmproj written for it yet).
_MULTIMODAL_PREFIXES = (
    "vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
    "image_newline", "model.image_newline", "model.visual.", "visual.",
)  # fmt: skip
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")

# (the common config.json fields, the GGUF tensor names) -> this arch's own config.json fields
ConfigExtra = Callable[[Mapping[str, Any], frozenset[str]], dict[str, Any]]
# (the GGUF writer, the normalised config.json) -> writes this arch's own keys after the common ones
ParamsExtra = Callable[[Any, Mapping[str, Any]], None]
# (the GGUF writer, the normalised config.json, the file type) -> writes every arch key (an arch whose converter
# writes its own set, in its own order)
Params = Callable[[Any, Mapping[str, Any], int], None]
# the normalised config.json -> tensors the converter makes from it, written before the checkpoint's (name, f32)
ExtraTensors = Callable[[Mapping[str, Any]], list[tuple[str, Any]]]
# (a layer tensor's HF suffix, its shape, the normalised config.json) -> (its GGUF shape, values -> written values)
Transform = Callable[
    [str, tuple[int, ...], Mapping[str, Any]], "tuple[tuple[int, ...], Callable[[Any, str], Any]] | None"
]
# (a GGUF's metadata, the config.json built so far) -> this arch's own config.json fields (GGUF -> HF)
GGUFConfig = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


def _no_extra(config: Mapping[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
    return {}


def _no_params(writer: Any, hp: Mapping[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class ArchSpec:
    """One decoder-only architecture as llama.cpp and transformers name it.

    gguf_arch: `general.architecture`.
    hf_model_types: config.json `model_type` values converted to this arch; the first is written back.
    hf_architectures: config.json `architectures[0]` of each of those model types, in the same order; the first
        is written by GGUF→HF.
    permute_qk: llama.cpp's `undo_permute` (docs/gguf.md, "Q/K permutation"): q/k rows are interleaved in
        the GGUF.
    llama_kv: also write `{arch}.vocab_size` and `rope.dimension_count`, and tokenizer_config.json's
        `add_prefix_space`, as llama.cpp's LlamaModel does (and no other).
    torch: the torch backend's Transformer runs every model type of it (backends/torch/model.py).
    experts: per-expert HF suffix (`model.layers.N.{expert_prefix}.E.` + suffix) <-> the GGUF suffix of the
        tensor that stacks every expert of layer N; empty for a dense arch.
    expert_prefix, expert_count_key: where the experts sit in a layer, and config.json's name for their count.
    params_extra: writes the arch's own keys after the common ones (`{arch}.expert_feed_forward_length`).
    params: writes all the arch keys instead of the common ones (Phi-3's converter has its own list).
    extra_tensors: tensors made from the config (llama3's rope_freqs, Phi-3's rope factors), written first.
    first_keys: keys llama.cpp's converter writes while it makes those tensors, so before all the others (Phi-3's
        rope attention factor comes right after general.architecture).
    norm_shift: added to every `*norm.weight` (Gemma's (1 + w) norms are stored with the 1 in), rounded as
        llama.cpp's converter rounds it (writer._in_dtype), and taken off again by GGUF -> HF.
    skip_tensors: checkpoint tensors llama.cpp's converter drops (Gemma 2's lm_head, always tied).
    vocab_rows: the model directory -> how many embedding rows to keep (Gemma 3 keeps the tokenizer's); None
        keeps them all.
    gguf_config: this arch's own config.json fields, written last by GGUF -> HF.
    check: the normalised config.json -> raises UnsupportedFormatError where llama.cpp would run this checkpoint
        as a different model (before anything is written, and for `--backend auto`).
    vocab: (the model directory, the normalised config.json) -> this arch's own GGUFVocab (Gemma's from a
        SentencePiece tokenizer.model), or None for the one read from tokenizer.json.
    stacked: tensors the checkpoint itself stacks over the experts (gpt-oss): the HF suffix inside a layer ->
        the GGUF suffixes it becomes, each with the rows of its output dimension it takes, (first, step). A float
        weight is [E, in, out] and is written [E, out, in]; a bias is [E, out]; an MXFP4 weight is its
        `_blocks` [E, out, in / 32, 16] and `_scales` [E, out, in / 32], written as ggml's MXFP4 blocks.
    transform: (a layer tensor's HF suffix, its shape, the normalised config.json) -> (its GGUF shape, a function of
        (its float32 values, the checkpoint's dtype) giving the values written), for a tensor llama.cpp's converter
        reshapes, reorders or recomputes (Qwen3.5's DeltaNet: A_log -> -exp, V heads regrouped); None for the rest.
    norm_shift_skip: layer suffixes of `*norm.weight` tensors norm_shift leaves alone (Qwen3.5's gated norm).
    to_hf: GGUF -> HF converts this arch back (gpt-oss and Qwen3.5 are one way only).
    """

    gguf_arch: str
    hf_model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    permute_qk: bool
    layer_tensors: tuple[tuple[str, str], ...]
    llama_kv: bool = False
    config_extra: ConfigExtra = field(default=_no_extra)
    torch: bool = False
    experts: tuple[tuple[str, str], ...] = ()
    expert_prefix: str = "mlp.experts"
    expert_count_key: str = "num_experts"
    params_extra: ParamsExtra = field(default=_no_params)
    params: Params | None = None
    extra_tensors: ExtraTensors | None = None
    first_keys: ParamsExtra = field(default=_no_params)
    norm_shift: float = 0.0
    skip_tensors: tuple[str, ...] = ()
    vocab_rows: Callable[[Path], int | None] | None = None
    gguf_config: GGUFConfig | None = None
    check: Callable[[Mapping[str, Any]], None] | None = None
    vocab: Callable[[Path, Mapping[str, Any]], Any] | None = None
    stacked: tuple[tuple[str, tuple[tuple[str, tuple[int, int]], ...]], ...] = ()
    transform: Transform | None = None
    norm_shift_skip: tuple[str, ...] = ()
    to_hf: bool = True

    @property
    def name(self) -> str:
        """The registry's key: the first HF model type (several archs may share one GGUF arch)."""
        return self.hf_model_types[0]

    @property
    def hf_architecture(self) -> str:
        return self.hf_architectures[0]

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF tensor name for an HF one, or None for a tensor llama.cpp does not use."""
        if m := _HF_LAYER.match(hf_name):
            to = dict(self.layer_tensors).get(m.group(2))
            return f"blk.{m.group(1)}.{to}" if to else None
        return dict(GLOBAL_TENSORS).get(hf_name)

    def hf_name(self, gguf_name: str) -> str | None:
        if m := _GGUF_LAYER.match(gguf_name):
            back = {g: h for h, g in self.layer_tensors}.get(m.group(2))
            return f"model.layers.{m.group(1)}.{back}" if back else None
        return {g: h for h, g in GLOBAL_TENSORS}.get(gguf_name)

    def stacked_parts(self, hf_name: str) -> tuple[tuple[str, slice], ...] | None:
        """The GGUF tensors (full names) and their rows, of a tensor the checkpoint stacks over the experts (its
        float name: an MXFP4 pair is looked up without `_blocks`); None for any other."""
        m = _HF_LAYER.match(hf_name)
        parts = dict(self.stacked).get(m.group(2)) if m else None
        return (
            tuple((f"blk.{m.group(1)}.{g}", slice(first, None, step)) for g, (first, step) in parts)
            if m and parts
            else None
        )

    def expert_of(self, hf_name: str) -> tuple[int, int, str] | None:
        """(layer, expert, the stacked tensor's GGUF name) of one expert's HF tensor; None for any other."""
        m = re.match(rf"^model\.layers\.(\d+)\.{re.escape(self.expert_prefix)}\.(\d+)\.(.+)$", hf_name)
        to = dict(self.experts).get(m.group(3)) if m else None
        return (int(m.group(1)), int(m.group(2)), f"blk.{m.group(1)}.{to}") if m and to else None

    def hf_expert_name(self, gguf_name: str, expert: int) -> str | None:
        """The HF name of one expert's slice of a stacked GGUF tensor; None if `gguf_name` stacks no experts."""
        m = _GGUF_LAYER.match(gguf_name)
        back = {g: h for h, g in self.experts}.get(m.group(2)) if m else None
        return f"model.layers.{m.group(1)}.{self.expert_prefix}.{expert}.{back}" if m and back else None


def language_model_name(hf_name: str) -> str | None:
    """The text-model name of a checkpoint tensor; None for a LLaVA's vision tower and projector.

    As llama.cpp's TextModel.filter_tensors: multimodal tensors are skipped and "language_model." is dropped, so
    llava-hf's `language_model.model.*` / `language_model.lm_head.*` and transformers 5's `model.language_model.*`
    become `model.*` / `lm_head.*`. A text model's names pass through unchanged.
    """
    if hf_name.startswith(_MULTIMODAL_PREFIXES):
        return None
    return hf_name.replace("language_model.", "")


@cache
def archs() -> dict[str, ArchSpec]:
    """Every architecture by its name (ArchSpec.name), each module imported on the first call."""
    from quantserve.gguf.archs.gemma import GEMMA2, GEMMA3
    from quantserve.gguf.archs.gpt_oss import GPT_OSS
    from quantserve.gguf.archs.llama import LLAMA, MIXTRAL
    from quantserve.gguf.archs.phi import PHI3
    from quantserve.gguf.archs.qwen import QWEN2, QWEN3, QWEN3_MOE
    from quantserve.gguf.archs.qwen35 import QWEN3_5, QWEN3_5_MOE

    specs = (LLAMA, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE, PHI3, GEMMA2, GEMMA3, GPT_OSS, QWEN3_5, QWEN3_5_MOE)
    return {spec.name: spec for spec in specs}


def torch_architectures() -> dict[str, str]:
    """The HF `architectures` names the torch backend runs, each with its model type (its Transformer's family)."""
    return {
        name: model_type
        for spec in archs().values()
        if spec.torch
        for name, model_type in zip(spec.hf_architectures, spec.hf_model_types, strict=True)
    }


def supported_hf_types() -> list[str]:
    return sorted(t for s in archs().values() for t in s.hf_model_types)


def arch_for_gguf(arch: str, tensor_names: frozenset[str] = frozenset()) -> ArchSpec:
    """The arch of a GGUF: by `general.architecture`, and where two archs share it (llama and Mixtral), by
    whether its tensors stack experts."""
    found = [s for s in archs().values() if s.gguf_arch == arch]
    if not found:
        known = ", ".join(sorted({s.gguf_arch for s in archs().values()}))
        raise UnsupportedFormatError(
            f"GGUF architecture '{arch}' cannot be converted to HF (supported: {known})"
        )
    moe = any(n.endswith("_exps.weight") for n in tensor_names)
    return next((s for s in found if bool(s.experts) == moe), found[0])


def arch_for_hf(config: Mapping[str, Any]) -> ArchSpec:
    """The arch for an HF config.json, by `model_type` (then `architectures[0]`).

    A LLaVA converts as its language model, by the text_config's model_type. llama.cpp's converter registers
    LlavaForConditionalGeneration with its LlamaModel only (conversion/llama.py), so for a llama or mistral text
    model the file is what it writes; a qwen2 or qwen3 one becomes the GGUF of that model on its own (the
    tensors under `language_model.`, as llama.cpp's filter drops the prefix), which libmtmd's projector feeds
    like any other: it only needs the text model's embedding width.

    Raises:
        UnsupportedFormatError: listing the supported model types (and, for a LLaVA, naming --backend torch).
    """
    if is_llava(config):
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        text_type = text.get("model_type", "llama")  # LlavaConfig's default text model
        spec = next((s for s in archs().values() if text_type in s.hf_model_types), None)
        if spec is None:
            raise UnsupportedFormatError(
                f"this LLaVA's language model is {text_type!r}, which the GGUF writer does not know (it knows "
                f"{', '.join(supported_hf_types())}); serve the checkpoint with --backend torch if that supports it"
            )
        return spec
    model_type = config.get("model_type")
    architectures = config.get("architectures") or [None]
    for spec in archs().values():
        if model_type in spec.hf_model_types or architectures[0] in spec.hf_architectures:
            return spec
    raise UnsupportedFormatError(
        f"config.json model_type {model_type!r} (architectures {architectures}) is not supported for conversion to "
        f"GGUF; supported model types: {', '.join(supported_hf_types())}"
    )
