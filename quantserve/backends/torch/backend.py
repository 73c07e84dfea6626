"""The torch backend: its plan for an HF checkpoint (dense, GPTQ, AWQ, compressed-tensors, Marlin) and the load
that carries it out: device and dtype, weights, the KV cache the plan sized."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from quantserve.backends import facts
from quantserve.core.model_size import model_shape, torch_kv
from quantserve.core.plan import ModelPlan
from quantserve.core.runner import Loaded, ModelInfo
from quantserve.core.settings import EngineSettings, cpu_threads
from quantserve.errors import BackendUnavailableError, ConfigError, UnsupportedFormatError, require_torch
from quantserve.formats import ModelSpec
from quantserve.formats.hf_config import is_llava

log = logging.getLogger("quantserve.torch")


def pick_device_dtype(config: dict):
    """CUDA in the checkpoint's half type (bf16 unless it says fp16); otherwise CPU in fp32 (CPU matmuls in bf16
    are slower here and less exact). Returns (torch.device, torch.dtype)."""
    import torch

    if torch.cuda.is_available():
        half = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return torch.device("cuda"), torch.float16 if half == "float16" else torch.bfloat16
    return torch.device("cpu"), torch.float32


class TorchBackend:
    """Our own model on Marlin-style W4A16 kernels, paged KV cache and CUDA graphs; CUDA, or the CPU."""

    name = "torch"

    def plan(self, spec: ModelSpec, settings: EngineSettings, reason: str) -> ModelPlan:
        """What load() will do with `spec`, from its config and headers.

        Raises:
            BackendUnavailableError: a GGUF, or no torch installed.
            ConfigError: a bad --chat-template file.
        """
        require_torch("the torch backend")
        if spec.format == "gguf":
            raise BackendUnavailableError(
                f"{spec.path} is GGUF; the torch backend reads HF checkpoints (dense, GPTQ, AWQ, "
                "compressed-tensors, Marlin). Serve it with --backend llamacpp, or convert it with `quantserve "
                f"convert --src {spec.path} --dst DIR`"
            )
        quant = settings.quant
        device, dtype = pick_device_dtype(spec.config or {})
        where = f"on {device.type} in {str(dtype).removeprefix('torch.')}"
        if spec.scheme is not None and spec.scheme.float_weights:
            scheme = spec.scheme
            # FP8: a byte and its scales; FP4: half a byte and an 8-bit scale per group
            size = "1 byte" if scheme.bits == 8 else f"{scheme.bits + 8 / scheme.group_size:g} bits"
            weights = (
                f"read the {spec.scheme.summary()} weights and keep them as they ship ({size} a weight), each "
                f"matmul decoding them to {str(dtype).removeprefix('torch.')} (activations are not quantized)"
            )
            if settings.torch.tensor_parallel_size > 1:
                raise ConfigError(
                    f"{spec.path} is {spec.scheme.label}, which the torch backend serves on one device for now; drop "
                    "--tensor-parallel-size, or serve it with --backend llamacpp",
                    param="tensor_parallel_size",
                )
        elif spec.scheme is not None:
            weights = f"read the {spec.scheme.summary()} weights and repack them for the W4A16 kernels"
        elif quant:
            weights = f"read the dense {spec.quant.get('dtype', '?')} weights and quantize them to {quant} (RTN W4A16)"
        else:
            weights = f"read the dense {spec.quant.get('dtype', '?')} weights"
        if spec.quant.get("experts") == "mxfp4":
            weights += " (the experts as MXFP4, as they ship: 4.25 bits a weight, decoded in the matmul)"
        llava = is_llava(spec.config)
        steps = [f"{weights}, {where}"]
        if llava:
            steps.append("load the CLIP vision tower and its projector")
        if windows := _window_step(spec):
            steps.append(windows)
        if hybrid := _hybrid_step(spec, settings, dtype.itemsize):
            steps.append(hybrid)
        if settings.torch.tensor_parallel_size > 1:
            steps.append(_split_step(spec, settings.torch.tensor_parallel_size, device.type, llava))
        shape = model_shape(spec)
        fill = device.type == "cuda" and settings.torch.kv_fill_gpu
        kv = (
            torch_kv(shape, settings, elem_bytes=dtype.itemsize, fill_gpu=fill) if shape is not None else None
        )
        if fill and not settings.kv_size:
            steps.append(
                f"size the KV cache to {settings.torch.gpu_memory_utilization:.0%} of the GPU's memory, less what "
                "the weights take"
            )
        vision = _llava_vision(spec.config or {}) if llava else None
        return facts.make_plan(
            spec, settings, (self.name, reason), tuple(steps), kv, quant=quant, vision=vision
        )

    def check(self, plan: ModelPlan) -> None:
        """Nothing to check before memory is spent: the torch backend runs no C code that can abort."""

    def load(self, plan: ModelPlan) -> Loaded:
        import torch

        from quantserve.backends.torch.fuse import fuse_projections
        from quantserve.backends.torch.runner import TorchRunner
        from quantserve.backends.torch.tokenizer import HFTokenizer
        from quantserve.backends.torch.weights import load_model

        spec, settings = plan.spec, plan.settings
        if threads := cpu_threads(settings.threads):
            torch.set_num_threads(threads)
        image_config = None
        if plan.vision is not None:  # its images must fit its tower: refused now, never by a request
            from quantserve.formats.image_processor import ImageProcessorConfig, check_tower

            image_config = ImageProcessorConfig.from_dir(spec.directory)
            check_tower(image_config, (spec.config or {}).get("vision_config") or {})
        device, dtype = pick_device_dtype(spec.config or {})
        tokenizer = HFTokenizer.from_dir(spec.directory)
        if settings.torch.tensor_parallel_size > 1:
            runner = _load_parallel(spec, settings, device)
            model = runner.inner.model
            vision = None
        else:
            model = load_model(spec, dtype=dtype, device=device, quant=settings.quant)
            fuse_projections(model)
            vision = None
            if image_config is not None:
                from quantserve.backends.torch.llava import load_vision

                vision = load_vision(spec, model.args.hidden_size, dtype, device)
            runner = TorchRunner(model, tokenizer, settings, device, vision, image_config, kv=plan.kv)
        n_params = sum(p.numel() for p in model.parameters()) * settings.torch.tensor_parallel_size
        n_params += sum(p.numel() for p in vision.parameters()) if vision is not None else 0
        return Loaded(
            runner=runner,
            info=ModelInfo(
                architecture=model.args.arch, n_params=n_params, format=spec.format, backend=self.name
            ),
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )


def load_slice(spec: ModelSpec, settings: EngineSettings, tp, device):
    """One tensor-parallel rank's runner: its slice of the model, its share of the KV cache (backends/torch/tp.py)."""
    import torch

    from quantserve.backends.torch.fuse import fuse_projections
    from quantserve.backends.torch.runner import TorchRunner
    from quantserve.backends.torch.tokenizer import HFTokenizer
    from quantserve.backends.torch.weights import load_model

    if threads := cpu_threads(settings.threads):
        torch.set_num_threads(threads)
    _, dtype = pick_device_dtype(spec.config or {})
    model = load_model(spec, dtype=dtype, device=device, quant=settings.quant, tp=tp)
    fuse_projections(model)
    return TorchRunner(model, HFTokenizer.from_dir(spec.directory), settings, device)


def _load_parallel(spec: ModelSpec, settings: EngineSettings, device):
    """Rank 0 of --tensor-parallel-size N: start the other ranks, load its own slice, and wrap it (the plan has
    refused a model that does not split, and a LLaVA one)."""
    import torch

    from quantserve.backends.torch.tp import RankLostError, TPRunner, start_group, torchrun_rank

    if device.type == "cuda" and torchrun_rank() is not None:  # one GPU per process, as torchrun numbers them
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    elif device.type == "cuda":
        n = torch.cuda.device_count()
        if n < settings.torch.tensor_parallel_size:
            raise ConfigError(
                f"--tensor-parallel-size {settings.torch.tensor_parallel_size} needs as many GPUs; this machine has "
                f"{n}",
                param="tensor_parallel_size",
            )
        device = torch.device("cuda", 0)
    group = start_group(spec.path, settings, device)
    try:
        inner = load_slice(spec, settings, group.tp, device)
        group.loaded()
    except RuntimeError as exc:  # a collective failed while loading: another rank did not load its slice
        time.sleep(0.5)
        gone = group.gone() or "a tensor-parallel rank stopped"
        group.abandon()
        raise RankLostError(f"{gone} while loading its slice of the model (its log above says why)") from exc
    except BaseException:
        group.abandon()
        raise
    return TPRunner(inner, group)


def _split_step(spec: ModelSpec, n: int, device: str, llava: bool) -> str:
    """What the plan says of --tensor-parallel-size n, once the model is known to split (else ConfigError)."""
    from quantserve.backends.torch.args import ModelArgs
    from quantserve.backends.torch.tp_shard import local_args

    if llava:
        raise ConfigError(
            "--tensor-parallel-size with a LLaVA model: the vision tower does not run under tensor parallel yet; "
            "serve it with --tensor-parallel-size 1",
            param="tensor_parallel_size",
        )
    a = ModelArgs.from_hf_config(dict(spec.config or {}))
    if (spec.quant or {}).get("experts") == "mxfp4":  # (as load_model reads gpt-oss's experts)
        a = dataclasses.replace(a, packed_experts=True)
    local_args(a, n)
    how = "NCCL, one GPU each" if device == "cuda" else "gloo, one process each"
    linear = (
        f", {a.deltanet[1] // n} of {a.deltanet[1]} DeltaNet value heads (and 1/{n} of each recurrent state)"
        if a.deltanet
        else ""
    )
    return (
        f"split over {n} ranks (tensor parallel, {how}): each holds {a.num_attention_heads // n} of "
        f"{a.num_attention_heads} attention heads and {a.num_key_value_heads // n} of {a.num_key_value_heads} KV heads "
        f"(1/{n} of the KV cache below){linear}, 1/{n} of the MLP rows and of the vocabulary"
    )


def _llava_vision(config: dict) -> str:
    v = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return (
        f"LLaVA: {v.get('model_type', 'clip_vision_model')} tower ({v.get('num_hidden_layers', '?')} blocks, "
        f"{v.get('image_size', '?')} px images in {v.get('patch_size', '?')} px patches, features of layer "
        f"{config.get('vision_feature_layer', -2)}), {config.get('projector_hidden_act', 'gelu')} MLP projector, "
        f"{text.get('model_type', 'llama')} language model"
    )


def _hybrid_step(spec: ModelSpec, settings: EngineSettings, elem_bytes: int) -> str | None:
    """What the plan says of a model with linear-attention layers (Qwen3.5): which layers, and what state each
    running sequence holds instead of their KV."""
    from quantserve.backends.torch.args import ModelArgs
    from quantserve.backends.torch.deltanet import state_bytes

    try:
        args = ModelArgs.from_hf_config(dict(spec.config or {}))
    except (UnsupportedFormatError, KeyError, TypeError, ValueError):
        return None
    if not args.deltanet:
        return None
    n_k, n_v, d_k, d_v, kernel = args.deltanet
    n_lin = args.layer_types.count("linear_attention")
    per_seq = n_lin * state_bytes(2 * n_k * d_k + n_v * d_v, kernel, n_v, d_k, d_v, elem_bytes)
    n = settings.torch.tensor_parallel_size
    split = f" (1/{n} of it on each of {n} ranks)" if n > 1 else ""
    return (
        f"{n_lin} of {len(args.layer_types)} layers are Gated DeltaNet (linear attention, no KV): each running "
        f"sequence keeps a {per_seq / 2**20:.2f} MiB recurrent state (conv window and delta state) in one of "
        f"{settings.max_num_seqs} slots, {settings.max_num_seqs * per_seq / 2**20:.1f} MiB in all{split}; prefix caching "
        "is off for this model (a state holds a whole prefix and is not kept per block), and a preempted sequence "
        "recomputes its state"
    )


def _window_step(spec: ModelSpec) -> str | None:
    """What the plan says of a model whose layers attend within a window: the masks are exact, and the KV is
    not bounded by the window (every layer shares one block table, so a block leaves when its sequence does)."""
    from quantserve.backends.torch.args import ModelArgs  # no torch import: the plan is made without it

    try:
        windows = ModelArgs.from_hf_config(dict(spec.config or {})).layer_windows
    except (UnsupportedFormatError, KeyError, TypeError, ValueError):
        return None
    local = [w for w in windows if w]
    if not local:
        return None
    ctx = (spec.config or {}).get("max_position_embeddings")
    if isinstance(ctx, int) and min(local) >= ctx:  # Phi-3-mini-128k's 262144 over its 131072 positions
        return f"sliding_window {min(local)} is not shorter than the model's {ctx}-token context: it never applies"
    return (
        f"attend within {max(local)} tokens in {len(local)} of {len(windows)} layers (exact masks); their KV is "
        "kept for the whole context, since every layer shares one block table, so the windows save no KV memory"
    )
