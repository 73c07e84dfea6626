"""Start the torch backend for a detected HF checkpoint: pick device and dtype, load weights, size the KV cache."""

from __future__ import annotations

import logging

import torch

from quantserve.core.runner import LoadedModel, ModelInfo
from quantserve.core.settings import EngineSettings
from quantserve.errors import BackendUnavailableError
from quantserve.formats import ModelSpec
from quantserve.formats.hf_config import is_llava

log = logging.getLogger("quantserve.torch")


def pick_device_dtype(config: dict) -> tuple[torch.device, torch.dtype]:
    """CUDA in the checkpoint's half type (bf16 unless it says fp16); otherwise CPU in fp32 (CPU matmuls in bf16
    are slower here and less exact)."""
    if torch.cuda.is_available():
        half = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return torch.device("cuda"), torch.float16 if half == "float16" else torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_torch(spec: ModelSpec, settings: EngineSettings) -> LoadedModel:
    if spec.format == "gguf":
        raise BackendUnavailableError(
            f"{spec.path} is GGUF; the torch backend reads HF checkpoints (dense, GPTQ, AWQ, compressed-tensors, "
            "Marlin). Serve it with --backend llamacpp, or convert it with `quantserve convert --src "
            f"{spec.path} --dst DIR`"
        )
    from quantserve.backends.torch.fuse import fuse_projections
    from quantserve.backends.torch.runner import TorchRunner
    from quantserve.backends.torch.tokenizer import HFTokenizer
    from quantserve.backends.torch.weights import load_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    image_config = None
    if is_llava(spec.config or {}):  # its images must fit its tower: refused now, never by a request
        from quantserve.formats.image_processor import ImageProcessorConfig, check_tower

        image_config = ImageProcessorConfig.from_dir(spec.directory)
        check_tower(image_config, (spec.config or {}).get("vision_config") or {})
    device, dtype = pick_device_dtype(spec.config or {})
    tokenizer = HFTokenizer.from_dir(spec.directory)
    model = load_model(spec, dtype=dtype, device=device, quant=settings.quant)
    fuse_projections(model)
    vision = None
    if image_config is not None:
        from quantserve.backends.torch.llava import load_vision

        vision = load_vision(spec, model.args.hidden_size, dtype, device)
    runner = TorchRunner(model, tokenizer, settings, device, vision, image_config)
    n_params = sum(p.numel() for p in model.parameters())
    n_params += sum(p.numel() for p in vision.parameters()) if vision is not None else 0
    return LoadedModel(
        runner=runner,
        info=ModelInfo(architecture=model.args.arch, n_params=n_params, format=spec.format, backend="torch"),
        chat_template=tokenizer.chat_template,
        template_origin=str(spec.directory / "tokenizer_config.json"),
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
    )
