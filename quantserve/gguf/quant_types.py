"""GGUF output types: parse `--quant`, and pick each tensor's ggml type the way llama.cpp's tools do.

Two writers share these rules. Types gguf-py can produce bit-exactly (F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1) are
written directly; K-quants, i-quants and their mixes go through llama.cpp's own quantizer (native_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F
from gguf.constants import GGML_QUANT_SIZES

from quantserve.errors import ConfigError


@dataclass(frozen=True)
class QuantTarget:
    name: str  # canonical lower-case spelling, e.g. "q4_k_m"
    ftype: F  # general.file_type, and llama_model_quantize's params.ftype
    direct: T | None  # the matrix type when we write it ourselves; None: llama.cpp quantizes
    # llama.cpp refuses to make it without an importance matrix: some of its tensors get a type that
    # llama-quant.cpp's tensor_requires_imatrix names (IQ1_*, IQ2_*, IQ3_XXS, and Q2_K in a Q2_K_S file)
    needs_imatrix: bool = False


QUANTS: dict[str, QuantTarget] = {
    q.name: q
    for q in (
        QuantTarget("f32", F.ALL_F32, T.F32),
        QuantTarget("f16", F.MOSTLY_F16, T.F16),
        QuantTarget("bf16", F.MOSTLY_BF16, T.BF16),
        QuantTarget("q8_0", F.MOSTLY_Q8_0, T.Q8_0),
        QuantTarget("q4_0", F.MOSTLY_Q4_0, T.Q4_0),
        QuantTarget("q4_1", F.MOSTLY_Q4_1, T.Q4_1),
        QuantTarget("q5_0", F.MOSTLY_Q5_0, T.Q5_0),
        QuantTarget("q5_1", F.MOSTLY_Q5_1, T.Q5_1),
        QuantTarget("q2_k", F.MOSTLY_Q2_K, None),
        QuantTarget("q3_k_s", F.MOSTLY_Q3_K_S, None),
        QuantTarget("q3_k_m", F.MOSTLY_Q3_K_M, None),
        QuantTarget("q3_k_l", F.MOSTLY_Q3_K_L, None),
        QuantTarget("q4_k_s", F.MOSTLY_Q4_K_S, None),
        QuantTarget("q4_k_m", F.MOSTLY_Q4_K_M, None),
        QuantTarget("q5_k_s", F.MOSTLY_Q5_K_S, None),
        QuantTarget("q5_k_m", F.MOSTLY_Q5_K_M, None),
        QuantTarget("q6_k", F.MOSTLY_Q6_K, None),
        QuantTarget("q2_k_s", F.MOSTLY_Q2_K_S, None, needs_imatrix=True),
        # the i-quants, llama-quantize's names; IQ3_XS gives some tensors IQ3_XXS, IQ2_M's main type is IQ2_S
        QuantTarget("iq4_xs", F.MOSTLY_IQ4_XS, None),
        QuantTarget("iq4_nl", F.MOSTLY_IQ4_NL, None),
        QuantTarget("iq3_m", F.MOSTLY_IQ3_M, None),
        QuantTarget("iq3_s", F.MOSTLY_IQ3_S, None),
        QuantTarget("iq3_xs", F.MOSTLY_IQ3_XS, None, needs_imatrix=True),
        QuantTarget("iq3_xxs", F.MOSTLY_IQ3_XXS, None, needs_imatrix=True),
        QuantTarget("iq2_m", F.MOSTLY_IQ2_M, None, needs_imatrix=True),
        QuantTarget("iq2_s", F.MOSTLY_IQ2_S, None, needs_imatrix=True),
        QuantTarget("iq2_xs", F.MOSTLY_IQ2_XS, None, needs_imatrix=True),
        QuantTarget("iq2_xxs", F.MOSTLY_IQ2_XXS, None, needs_imatrix=True),
        QuantTarget("iq1_m", F.MOSTLY_IQ1_M, None, needs_imatrix=True),
        QuantTarget("iq1_s", F.MOSTLY_IQ1_S, None, needs_imatrix=True),
    )
}
# Shorthands: a bare K-quant means its _M mix, as llama-quantize's presets recommend.
ALIASES = {
    "fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16", "bfloat16": "bf16", "q8": "q8_0",
    "q2k": "q2_k", "q3k": "q3_k_m", "q3_k": "q3_k_m", "q4k": "q4_k_m", "q4_k": "q4_k_m",
    "q5k": "q5_k_m", "q5_k": "q5_k_m", "q6k": "q6_k",
}  # fmt: skip
_LEGACY_4_5 = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}


def parse_quant(text: str) -> QuantTarget:
    """`Q4_K_M`, `q4k`, `f16`... -> QuantTarget (case-insensitive; '-' and '_' interchangeable).

    Raises:
        ConfigError: an unknown type, listing the accepted ones.
    """
    key = text.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in QUANTS:
        raise ConfigError(
            f"unknown --quant {text!r}; choose one of {', '.join(QUANTS)} (shorthands: q4k = q4_k_m, q5k = q5_k_m)"
        )
    return QUANTS[key]


def keeps_f32(name: str, n_dims: int) -> bool:
    """Norms, biases, other vectors, MoE routers and a DeltaNet's conv stay F32 in every file type
    (convert_hf_to_gguf.py prepare_tensors)."""
    return (
        n_dims <= 1
        or name.endswith(
            ("_norm.weight", ".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")
        )
        or not name.endswith(".weight")
    )


def direct_tensor_type(name: str, ne: tuple[int, ...], target: QuantTarget, tied_embeddings: bool) -> T:
    """The ggml type our direct writer gives one tensor (`ne` in GGUF order: ne[0] is the row length).

    F32/F16/BF16/Q8_0 follow convert_hf_to_gguf.py: every matrix gets the target type. For Q4_0/1 and
    Q5_0/1 llama-quantize's llama_tensor_get_type_impl also applies: the output matrix (or the token
    embedding when it doubles as output) becomes Q6_K, or Q8_0 when its rows are not a multiple of 256.
    A row length the block size does not divide falls back to F16 in both tools.
    """
    assert target.direct is not None, "K-quants are chosen by llama.cpp's quantizer"
    if keeps_f32(name, len(ne)):
        return T.F32
    qtype = target.direct
    if qtype in _LEGACY_4_5 and (
        name == "output.weight" or (tied_embeddings and name == "token_embd.weight")
    ):
        qtype = T.Q6_K if ne[0] % 256 == 0 else T.Q8_0
    if ne[0] % GGML_QUANT_SIZES[qtype][0]:
        qtype = T.F16
    return qtype


def n_bytes(qtype: T, ne: tuple[int, ...]) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = ne[0] // block * type_size
    for d in ne[1:]:
        n *= d
    return n
