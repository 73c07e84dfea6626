"""Each kind of plug-in has one literal list (schemes(), the chat formats' registered(), archs(), writers()): a module
added to one of those packages and forgotten in its list would be silently ignored, so every module there must define
exactly one entry of its list (helpers excepted, by name)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from quantserve.chat.formats import ToolFormat, registered
from quantserve.formats.schemes import QuantScheme, schemes
from quantserve.gguf.archs import ArchSpec, archs, torch_architectures

HELPERS = {"quantserve.formats.schemes.fingerprint", "quantserve.converters.hf_quant.writer"}


def _modules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return [
        f"{package}.{m.name}"
        for m in pkgutil.iter_modules(pkg.__path__)
        if f"{package}.{m.name}" not in HELPERS
    ]


def _defined(module: str, kind: type) -> list[object]:
    mod = importlib.import_module(module)
    if kind is ArchSpec:
        return [v for v in vars(mod).values() if isinstance(v, ArchSpec)]
    return [
        v for v in vars(mod).values() if inspect.isclass(v) and issubclass(v, kind) and v.__module__ == module
    ]


def test_every_scheme_chat_format_and_architecture_module_is_listed():
    for package, kind, listed in (
        ("quantserve.formats.schemes", QuantScheme, set(schemes().values())),
        ("quantserve.chat.formats", ToolFormat, set(registered())),
        ("quantserve.gguf.archs", ArchSpec, set(archs().values())),
    ):
        # a class is listed, or is the shared base of listed ones (chat.formats.marked.Marked)
        bases = {b for c in listed if inspect.isclass(c) for b in c.__mro__[1:]}
        for module in _modules(package):
            found = _defined(module, kind)
            assert found and set(found) <= listed | bases, (
                f"{module} defines {found}, not all in its package's list"
            )


def test_every_writer_module_is_listed():
    pytest.importorskip("torch")
    from quantserve.converters.hf_quant.writer import LayerEncoder, writers

    for module in _modules("quantserve.converters.hf_quant"):
        found = _defined(module, LayerEncoder)
        assert found and set(found) <= set(writers().values()), f"{module}: {found}"
    # a writer for every scheme detect() reads but those it reads only (FP8, MXFP4: float codes no writer makes yet;
    # compressed-tensors' int-quantized INT8, which repacks into the 8-bit layouts that are written)
    writable = {name for name, cls in schemes().items() if cls.writable}
    floats = {"fp8", "compressed-tensors-fp8", "compressed-tensors-mxfp4", "compressed-tensors-nvfp4"}
    assert set(writers()) == writable == set(schemes()) - floats - {"compressed-tensors-int8"}
    assert {name for name, cls in schemes().items() if cls.float_weights} == floats


def test_the_torch_backend_runs_what_the_registry_marks():
    assert torch_architectures() == {
        "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Phi3ForCausalLM": "phi3",
        "MixtralForCausalLM": "mixtral", "GptOssForCausalLM": "gpt_oss", "Qwen3_5ForCausalLM": "qwen3_5_text",
        "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5ForConditionalGeneration": "qwen3_5",
        "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
        # the multimodal Gemma 3 for its language model
        "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3",
    }  # fmt: skip


def test_every_tensor_name_table_agrees_with_gguf_pys_own_map():
    """The archs' HF <-> GGUF name tables (both directions need one table) say what gguf-py's tensor map for that
    architecture says (`gguf.get_tensor_name_map`, what convert_hf_to_gguf.py maps with), experts included as
    llama.cpp's converters name them once stacked (or split, for gpt-oss's gate|up: each part as
    conversion/gpt_oss.py names it before mapping); tensors an arch drops (Gemma 2's lm_head) excepted. A name
    without a suffix gets `.weight` where the GGUF name has one (gpt-oss's sinks, as its converter gives it; not
    Qwen3.5's A_log, which stays `ssm_a`)."""
    import gguf

    from quantserve.gguf.archs import GLOBAL_TENSORS, archs

    by_name = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    for spec in archs().values():
        theirs = gguf.get_tensor_name_map(by_name[spec.gguf_arch], 2)
        pairs = [p for p in GLOBAL_TENSORS if p[0] not in spec.skip_tensors]
        pairs += [(f"model.layers.1.{hf}", f"blk.1.{name}") for hf, name in spec.layer_tensors]
        pairs += [(f"model.layers.1.{spec.expert_prefix}.{hf}", f"blk.1.{name}") for hf, name in spec.experts]
        for hf, parts in spec.stacked:
            for name, _ in parts:  # mlp.experts.gate_up_proj_bias -> its gate part mlp.experts.gate_proj.bias
                kind = "bias" if hf.endswith("_bias") else "weight"
                part = name.split(".")[0].removeprefix("ffn_").removesuffix("_exps")
                pairs.append((f"model.layers.1.mlp.experts.{part}_proj.{kind}", f"blk.1.{name}"))
        for hf, name in pairs:
            hf = _CONVERTER_RENAMES.get(hf.rpartition("layers.1.")[2], hf)
            if not hf.endswith((".weight", ".bias")) and name.endswith(".weight"):
                hf += ".weight"
            assert theirs.get_name(hf, try_suffixes=(".weight", ".bias")) == name, (spec.name, hf)


# tensors llama.cpp's converters rename before mapping (conversion/qwen.py: Qwen3NextModel)
_CONVERTER_RENAMES = {"linear_attn.dt_bias": "model.layers.1.linear_attn.dt_proj.bias"}
