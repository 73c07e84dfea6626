"""The facts about a model that both backends' plans share, each computed here and nowhere else: where its chat
template is, its tool-call format, what it can do, and how many bytes its weights take in memory. Headers and
configs only."""

from __future__ import annotations

import json
from pathlib import Path

from quantserve.chat import ChatTemplate, tool_format
from quantserve.chat.template import read_template_file
from quantserve.core.plan import CAPABILITIES, KVPlan, ModelPlan, TemplateSource
from quantserve.core.settings import EngineSettings
from quantserve.errors import ConfigError
from quantserve.formats import ModelSpec, read_gguf_info, read_safetensors_header
from quantserve.formats.hf_config import find_chat_template

_SOURCE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "float32": 32, "float16": 16, "bfloat16": 16}


def chat_template(spec: ModelSpec, settings: EngineSettings) -> TemplateSource | None:
    """--chat-template (or models.toml's chat_template), else the GGUF's tokenizer.chat_template, else an HF
    checkpoint's (formats.hf_config.find_chat_template).

    Raises:
        ConfigError: the --chat-template file cannot be read.
    """
    info = read_gguf_info(spec.files[0]) if spec.format == "gguf" else None
    bos, eos = _special_texts(spec, info.metadata if info else None)
    if settings.chat_template:
        path = Path(settings.chat_template).expanduser()
        return TemplateSource(read_template_file(path), f"--chat-template {path}", bos, eos)
    if info is not None:
        text = info.chat_template
        where = f"tokenizer.chat_template in {spec.files[0].name}"
        return TemplateSource(text, where, bos, eos) if text else None
    found = find_chat_template(spec.directory)
    return TemplateSource(found[0], str(found[1]), bos, eos) if found else None


def _special_texts(spec: ModelSpec, gguf_metadata: dict | None) -> tuple[str, str]:
    """The BOS and EOS tokens' text as the files name them: a GGUF's tokenizer.ggml.tokens at its bos/eos ids,
    an HF checkpoint's tokenizer_config.json bos_token/eos_token (a string or an AddedToken's content). The
    loaded tokenizer has the last word (LLM.load); where the two agree, the template is probed once."""
    if gguf_metadata is not None:
        tokens = gguf_metadata.get("tokenizer.ggml.tokens") or []

        def text(key: str) -> str:
            i = gguf_metadata.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        return text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id")
    try:
        config = json.loads((spec.directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "", ""

    def named(key: str) -> str:
        entry = config.get(key) if isinstance(config, dict) else None
        entry = entry.get("content") if isinstance(entry, dict) else entry
        return entry if isinstance(entry, str) else ""

    return named("bos_token"), named("eos_token")


def template_formats(template: TemplateSource | None) -> tuple[str | None, str | None]:
    """The template's tool-call format and how it marks reasoning, in words (None: no template, or no reasoning),
    as quantserve.chat reads them from one set of probe renders.

    Raises:
        ConfigError: the template does not parse.
    """
    if template is None:
        return None, None
    probed = ChatTemplate.shared(template.text, template.bos_token, template.eos_token, template.origin)
    reasoning = probed.reasoning
    return tool_format(probed).name, reasoning.describe() if reasoning is not None else None


def capabilities(
    *, template: TemplateSource | None, vision: bool, embeds: bool, rank_outputs: int, reasons: bool = False
) -> tuple[str, ...]:
    """What the model can be asked, in CAPABILITIES' order. A reranker (a classification head) only ranks, and
    only where its head gives a relevance (one or two outputs); a chat template gives chats, tools in its format,
    and yes/no reranking (quantserve.rerank)."""
    if rank_outputs:
        have = {"rerank"} if rank_outputs <= 2 else set()
    else:
        chat = template is not None
        have = {"completion"} | ({"chat", "tools", "rerank"} if chat else set())
        have |= {"vision"} if vision else set()
        have |= {"embeddings"} if embeds else set()
        have |= {"reasoning"} if reasons else set()
    return tuple(c for c in CAPABILITIES if c in have)


def _target_bits(quant: str | None) -> float | None:
    """Bits per weight of what a dense checkpoint becomes at load; None: it is served as it is."""
    if not quant:
        return None
    if quant.lower() == "int4":  # the torch backend's in-situ W4A16, group 128, plus its scales
        return 4.25
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    from quantserve.gguf.quant_types import parse_quant

    try:
        target = parse_quant(quant)
    except ConfigError:
        return None  # the load itself says what is wrong with it
    main = target.direct
    if main is None and target.name[2:4] == "_k":  # a k-quant mix: its main type (q4_k_m -> Q4_K)
        main = T[target.name[:4].upper()]
    if main is None:
        return None
    block, size = GGML_QUANT_SIZES[main]
    return 8 * size / block


def weight_bytes(spec: ModelSpec, quant: str | None) -> int:
    """The weights' bytes once loaded: the files' sizes, scaled to the load-time quantization of a dense
    checkpoint (the tokenizer and such are left out)."""
    weights = sum(Path(f).stat().st_size for f in spec.files)
    bits = _target_bits(quant)
    source = _SOURCE_BITS.get(str(spec.quant.get("dtype", "")))
    if bits is not None and source is not None:
        kept = 0  # gpt-oss's MXFP4 experts keep their bytes whatever the rest becomes
        if spec.quant.get("experts") == "mxfp4":
            headers = [read_safetensors_header(f) for f in spec.files]
            kept = sum(
                t.n_bytes for h in headers for n, t in h.tensors.items() if n.endswith(("_blocks", "_scales"))
            )
        weights = kept + int((weights - kept) * bits / source)
    return weights


def make_plan(
    spec: ModelSpec,
    settings: EngineSettings,
    choice: tuple[str, str],
    steps: tuple[str, ...],
    kv: KVPlan | None,
    *,
    quant: str | None = None,
    architecture: str | None = None,
    vision: str | None = None,
    mmproj: Path | None = None,
    rank_outputs: int = 0,
) -> ModelPlan:
    """A backend's plan with the facts computed here: the template (a reranker has none: it never chats), its
    tool-call format, the weights' bytes after `quant`, and the capabilities, every backend embedding. `choice`:
    the backend and why; `architecture`: the spec's unless given (a GGUF's general.architecture)."""
    template = None if rank_outputs else chat_template(spec, settings)
    tool_format_name, reasoning = template_formats(template)
    return ModelPlan(
        spec=spec,
        settings=settings,
        architecture=architecture or spec.architecture,
        backend=choice[0],
        reason=choice[1],
        steps=steps,
        kv=kv,
        weight_bytes=weight_bytes(spec, quant),
        template=template,
        tool_format=tool_format_name,
        reasoning=reasoning,
        capabilities=capabilities(
            template=template,
            vision=vision is not None,
            embeds=True,
            rank_outputs=rank_outputs,
            reasons=reasoning is not None,
        ),
        vision=vision,
        mmproj=mmproj,
        rank_outputs=rank_outputs,
    )
