"""What the torch backend's model is built from: a config.json read into ModelArgs (the architecture, the sizes,
the rope and, for a mixture of experts, its routing), refusing what the model does not implement."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from quantserve.errors import UnsupportedFormatError
from quantserve.formats.hf_config import GEMMA_DEFAULTS, WRAPPERS, layer_windows, quant_method_of
from quantserve.gguf.archs import torch_architectures


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qwen2: q/k/v carry a bias
    qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: tuple[tuple[str, Any], ...] = field(default=())  # sorted items of HF's rope_scaling dict
    rotary_dim: int = 0  # the head dimensions that rotate, the first ones (partial_rotary_factor); 0: all
    # a mixture of experts (qwen3_moe): every layer's MLP routes each token to num_experts_per_tok of num_experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_size: int = (
        0  # Qwen3.5-MoE: a shared expert's width (its output gated by shared_expert_gate)
    )
    fused: bool = (
        False  # phi3: the checkpoint's q|k|v and gate|up are one linear each (qkv_proj, gate_up_proj)
    )
    # gemma2 / gemma3: (1 + w) norms (norm_offset 1, added at load), the embedding scaled by sqrt(hidden), GeGLU,
    # a norm after attention and around the MLP (sandwich), q.k scaled by query_pre_attn_scalar^-1/2, tanh caps
    # on the attention and final logits (gemma2), and layers that attend within a window
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh"
    query_pre_attn_scalar: float = 0.0  # 0: head_dim
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    layer_windows: tuple[int, ...] = ()  # per layer: attend to the last N positions (0: all); empty: none
    rope_local_theta: float = 0.0  # gemma3: the windowed layers' rope base (no scaling); 0: one rope for all
    # gpt-oss: a learned logit per head in each attention softmax (sinks), a bias on o_proj too, and experts with
    # biases and a clamped SwiGLU (alpha, limit; backends/torch/gpt_oss.py), shipped as MXFP4 (packed_experts)
    attn_sinks: bool = False
    attn_out_bias: bool = False
    swiglu: tuple[float, float] = ()
    packed_experts: bool = False
    # Qwen3.5 (hybrid): each layer's kind, "linear_attention" (Gated DeltaNet, backends/torch/deltanet.py) or
    # "full_attention"; the DeltaNet's (key heads, value heads, key dim, value dim, conv kernel); and the full
    # attention layers' sigmoid output gate (q_proj gives each head's query and gate side by side)
    layer_types: tuple[str, ...] = ()
    deltanet: tuple[int, int, int, int, int] = ()
    attn_output_gate: bool = False
    # how the checkpoint's names differ from this model's (Mixtral: `block_sparse_moe.experts.E.w1`), as
    # (theirs, ours) fragments
    checkpoint_names: tuple[tuple[str, str], ...] = ()

    @property
    def wrapped(self) -> bool:
        """The language model of a multimodal checkpoint (its other tensors are not this model's)."""
        return self.checkpoint_names == WRAPPED_NAMES

    def our_name(self, name: str) -> str:
        """A checkpoint tensor's (or linear's) name in this model's modules."""
        name += "."  # a linear's prefix ends in its own name: let the fragments match there too
        for theirs, ours in self.checkpoint_names:
            name = name.replace(theirs, ours)
        return name[:-1]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Raises UnsupportedFormatError for architectures this model does not implement."""
        names = cfg.get("architectures") or []
        if names and names[0] in WRAPPERS:  # a multimodal wrapper: its language model, under its own names
            return replace(cls.from_hf_config(_wrapped_text(cfg)), checkpoint_names=WRAPPED_NAMES)
        known = torch_architectures()
        arch = next((known[n] for n in names if n in known), None)
        if arch in GEMMA_DEFAULTS:  # Gemma's configs leave out what their config class defaults
            cfg = {**GEMMA_DEFAULTS[arch], **cfg}
        if arch in HYBRID:  # Qwen3_5TextConfig's defaults for what a trimmed config leaves out
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            base = {"rope_theta": cfg.get("rope_theta", 10000.0),
                    "partial_rotary_factor": cfg.get("partial_rotary_factor", 0.25)}  # fmt: skip
            cfg = {
                "head_dim": 256,
                "max_position_embeddings": 32768,
                **cfg,
                "rope_parameters": {**base, **rope},
            }
        if arch == "gpt_oss" and not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
            cfg = {**GPT_OSS_DEFAULTS, **cfg}
        elif arch == "gpt_oss":
            cfg = {**{k: v for k, v in GPT_OSS_DEFAULTS.items() if k != "rope_parameters"}, **cfg}
        if arch is None:
            raise UnsupportedFormatError(
                f"architecture {names or cfg.get('model_type')!r} is not supported by the torch backend "
                f"(supported: {', '.join(known)}); use --backend llamacpp with a GGUF"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters (per layer type for gemma3).
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        gemma = _gemma_args(cfg, rope, arch) if arch in GEMMA else {}
        if "full_attention" in rope:
            rope = dict(rope["full_attention"])
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if arch == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config's own renaming of its older configs
            rope_type = "longrope"
        if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise UnsupportedFormatError(
                f"rope scaling {rope_type!r} is not supported by the torch backend (supported: linear, llama3, "
                "yarn, longrope); use --backend llamacpp"
            )
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * partial)  # transformers' Phi-3: int(head_dim * partial_rotary_factor)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise UnsupportedFormatError(
                f"partial_rotary_factor {partial} rotates {rotary_dim} of {head_dim} head dimensions: it must be an "
                "even number of them, at least 2; the config is damaged"
            )
        if rope_type == "longrope":  # Phi-3 names its original context outside rope_scaling, which wins there
            orig = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
            if not isinstance(orig, int):
                raise UnsupportedFormatError(
                    "config.json's longrope scaling has no original_max_position_embeddings (the context its short "
                    "factors serve); the config is incomplete"
                )
            rope["original_max_position_embeddings"] = orig
        rope = {k: tuple(v) if isinstance(v, list) else v for k, v in rope.items()}
        scaling = () if rope_type == "default" else tuple(sorted({**rope, "rope_type": rope_type}.items()))
        # gpt-oss: softmax over the top k; Qwen3.5-MoE always renormalises
        renormalize = True if arch in ("mixtral", "gpt_oss", "qwen3_5_moe_text") else None
        moe = _moe_args(cfg, renormalize) if arch in MOE else {}
        oss = _gpt_oss_args(cfg) if arch == "gpt_oss" else {}
        hybrid = _hybrid_args(cfg) if arch in HYBRID else {}
        try:  # Mistral, Mixtral and Phi-3 window every layer (when set); Gemma's layers each have their own
            windows = layer_windows(cfg)
        except ValueError as exc:
            raise UnsupportedFormatError(str(exc)) from exc
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 0,
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            # Llama/Qwen2 default to untied; a missing lm_head is caught when loading weights.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA)),  # Gemma ties by default
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", arch == "gpt_oss")),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text", *HYBRID),
            rope_scaling=scaling,
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            **moe,
            fused=arch == "phi3",
            checkpoint_names=MIXTRAL_NAMES if arch == "mixtral" else (),
            layer_windows=windows,
            **gemma,
            **oss,
            **hybrid,
        )


GEMMA = ("gemma2", "gemma3_text")


def _gemma_args(cfg: dict[str, Any], rope: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 2 / 3's own fields (transformers' Gemma2Config / Gemma3TextConfig names and defaults).

    Raises:
        UnsupportedFormatError: an activation other than tanh-approximated GELU.
    """
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedFormatError(
            f"Gemma with activation {act!r}: the torch backend runs gelu_pytorch_tanh"
        )
    local = rope.get("sliding_attention", {}).get("rope_theta") or cfg.get("rope_local_base_freq")
    return {
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": True,
        "hidden_act": "gelu_tanh",
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        "attn_softcap": float(cfg.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
        "rope_local_theta": float(local or 10000.0) if arch == "gemma3_text" else 0.0,
    }


# where they keep it: transformers 5's own layout, and the hub's (what save_pretrained writes back)
WRAPPED_NAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))  # fmt: skip


def _wrapped_text(cfg: dict[str, Any]) -> dict[str, Any]:
    text = dict(cfg.get("text_config") or {})
    if not text.get("hidden_size") or not text.get("num_hidden_layers"):
        raise UnsupportedFormatError(
            f"config.json of a {cfg['architectures'][0]} has no text_config with the language model's sizes"
        )
    # what the wrapper's config class defaults to: Gemma 3 ties, Qwen3.5 does not
    tied = cfg.get(
        "tie_word_embeddings", text.get("tie_word_embeddings", cfg["architectures"][0].startswith("Gemma"))
    )
    return {**text, "architectures": [WRAPPERS[cfg["architectures"][0]]], "tie_word_embeddings": tied}


# transformers' GptOssConfig defaults for the shared keys, which a trimmed config.json may leave out
GPT_OSS_DEFAULTS = {
    "head_dim": 64, "rms_norm_eps": 1e-5, "sliding_window": 128, "attention_bias": True, "rope_theta": 150000.0,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
}  # fmt: skip


def _gpt_oss_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's own fields (transformers' GptOssConfig names and defaults).

    Raises:
        UnsupportedFormatError: a quantization other than MXFP4 experts, or sizes MXFP4 blocks cannot tile.
    """
    qc = cfg.get("quantization_config")
    method = quant_method_of(qc) if isinstance(qc, dict) else None
    if method not in (None, "mxfp4"):
        raise UnsupportedFormatError(
            f"a gpt-oss checkpoint quantized with {method!r}: the torch backend reads gpt-oss as released (MXFP4 "
            "experts) or in bf16/fp16/fp32"
        )
    ff = cfg.get("intermediate_size")
    if method == "mxfp4" and (cfg["hidden_size"] % 32 or not isinstance(ff, int) or ff % 32):
        raise UnsupportedFormatError(
            f"config.json's hidden_size {cfg['hidden_size']} and intermediate_size {ff} must be multiples of 32 "
            "for MXFP4 experts (32 values to a scale); the checkpoint's config is damaged"
        )
    return {
        "attn_sinks": True,
        "attn_out_bias": bool(cfg.get("attention_bias", True)),
        "swiglu": (float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
        "packed_experts": method == "mxfp4",
    }


HYBRID = ("qwen3_5_text", "qwen3_5_moe_text")


def _hybrid_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's own fields (transformers' Qwen3_5TextConfig names and defaults): its (1 + w) norms, the layer
    kinds and the DeltaNet's sizes.

    Raises:
        UnsupportedFormatError: layer_types that do not name linear_attention or full_attention for each layer, or
            value heads that are not a multiple of the key heads.
    """
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedFormatError(
            f"config.json's layer_types {types!r} does not name linear_attention or full_attention for each of its "
            f"{n} layers; the config is damaged"
        )
    n_k, n_v = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
    if n_v % n_k:
        raise UnsupportedFormatError(
            f"config.json's linear_num_value_heads {n_v} is not a multiple of linear_num_key_heads {n_k}"
        )
    return {
        "norm_offset": 1.0,
        "layer_types": tuple(types),
        "deltanet": (
            n_k,
            n_v,
            int(cfg.get("linear_key_head_dim", 128)),
            int(cfg.get("linear_value_head_dim", 128)),
            int(cfg.get("linear_conv_kernel_dim", 4)),
        ),  # fmt: skip
        "attn_output_gate": True,
    }


MOE = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text")
# Mixtral's expert MLPs are w1 (gate), w2 (down) and w3 (up) under `block_sparse_moe`
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w2.", ".down_proj."),
                 (".w3.", ".up_proj."))  # fmt: skip


def _moe_args(cfg: dict[str, Any], renormalize: bool | None) -> dict[str, Any]:
    """A mixture of experts' routing, from config.json (`renormalize`: what the family always does; None: its
    config's norm_topk_prob says).

    Raises:
        UnsupportedFormatError: dense layers among the MoE ones, or a top-k the expert count cannot give.
    """
    n = cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg.get("num_experts_per_tok")
    if not isinstance(n, int) or not isinstance(k, int) or not 0 < k <= n:
        raise UnsupportedFormatError(
            f"config.json's num_experts ({n}) and num_experts_per_tok ({k}) do not describe a mixture of experts; "
            "the checkpoint's config is damaged"
        )
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedFormatError(
            "config.json has dense layers among the MoE ones (mlp_only_layers / decoder_sparse_step), which the "
            "torch backend does not run; use --backend llamacpp"
        )
    return {
        "num_experts": n,
        "num_experts_per_tok": k,
        "moe_intermediate_size": cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        "norm_topk_prob": renormalize if renormalize is not None else bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_size": int(cfg.get("shared_expert_intermediate_size") or 0),
    }
