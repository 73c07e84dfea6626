"""How many of a GGUF's layers llama.cpp puts on the GPU: `--n-gpu-layers auto` (the default), as llama-server's
`-ngl auto --fit` does.

llama.cpp offloads the *last* n repeating layers (each with its share of the KV cache), and with n past the layer
count the output layer too. Its own fitting (common/fit.cpp, `llama_params_fit`) lives in libcommon, which
llama-cpp-python does not load, so the same decision is made here from the file: each layer's tensor bytes from
the GGUF header, the KV cache's bytes per layer from the metadata and the settings (core/model_size.py), the
device's free memory from ggml's own device list, and llama-server's default margin of 1 GiB per device
(common/common.h, fit_params_target) plus the compute buffers. Everything fits: every layer and the output.
Otherwise as many layers as fit. A build without GPU offload (this CPU build) gets 0, quietly.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from quantserve.core.model_size import gguf_shape, layer_kv_bytes, llamacpp_kv
from quantserve.core.settings import EngineSettings, LlamaCppSettings, parse_tensor_split
from quantserve.errors import ConfigError
from quantserve.formats import read_gguf_info

MARGIN = 1 << 30  # llama-server's --fit-target default: 1024 MiB left free on each device
ALL = 0x7FFFFFFF  # what llama.cpp takes for "every layer" (the n_gpu_layers of -1 / "all")
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    free: int
    total: int
    count: int = 1  # devices taken together (each keeps llama-server's margin free)


@dataclass(frozen=True)
class Offload:
    """The decision: layers for llama.cpp's n_gpu_layers (ALL for every one), where, and why."""

    n_gpu_layers: int
    n_layer: int
    device: str | None
    reason: str

    def describe(self) -> str:
        if self.device is None or self.n_gpu_layers == 0:
            where = "all layers on the CPU"
        elif self.n_gpu_layers >= self.n_layer:
            where = f"all {self.n_layer} layers and the output on {self.device}"
        else:
            where = f"{self.n_gpu_layers} of {self.n_layer} layers on {self.device}, the rest on the CPU"
        return f"{where} ({self.reason})"


def fit_layers(
    layer_bytes: list[int],
    output_bytes: int,
    kv_per_layer: int,
    buffers: int,
    free: int,
    margin: int = MARGIN,
) -> int:
    """Layers to offload: ALL when every layer, its KV and the output fit in `free` less `margin` and the compute
    `buffers`; else the most of the last layers that fit (llama.cpp offloads from the end); 0 when none does."""
    room = free - margin - buffers
    need = [b + kv_per_layer for b in layer_bytes]
    if sum(need) + output_bytes <= room:
        return ALL
    n = 0
    for cost in reversed(need):
        if cost > room:
            break
        room -= cost
        n += 1
    return n


def _ggml():
    """libggml, as libllama loaded it, with the device functions typed."""
    from quantserve.backends.llamacpp.library import libggml

    lib = libggml()
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    return lib


GPU_TYPES = (
    1,
    2,
)  # enum ggml_backend_dev_type: CPU 0, GPU 1, IGPU 2 (Apple silicon's Metal is a GPU), ACCEL 3


def gpu_device(own: LlamaCppSettings | None = None) -> Device | None:
    """What llama.cpp offloads to, as one device: its devices in llama.cpp's order (RPC workers' first, then the
    GPUs, then integrated GPUs only where there is no discrete one), taken as `own`'s split says. A layer split
    adds up their free memory, bounded by the device that --tensor-split fills first; --split-mode none takes
    --main-gpu alone. None when there is no device (a CPU build).

    Raises:
        ConfigError: --main-gpu past the devices there are.
    """
    from quantserve.backends.llamacpp.library import init_backend

    init_backend()
    lib = _ggml()
    rpc, gpus, igpus = [], [], []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind not in GPU_TYPES:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = lib.ggml_backend_dev_name(dev).decode(errors="replace")
        desc = lib.ggml_backend_dev_description(dev).decode(errors="replace")
        d = Device(name, desc, free.value, total.value)
        (rpc if name.startswith("RPC") else gpus if kind == 1 else igpus).append(d)
    found = rpc + gpus + (igpus if not (rpc or gpus) else [])  # llama.cpp's rule
    if not found:
        return None
    own = own or LlamaCppSettings()
    if own.split_mode == "none":
        if own.main_gpu >= len(found):
            raise ConfigError(
                f"--main-gpu {own.main_gpu}: llama.cpp has {len(found)} device(s) here "
                f"({', '.join(d.name for d in found)}), counted from 0",
                param="main_gpu",
            )
        return found[own.main_gpu]
    if len(found) == 1:
        return found[0]
    free = sum(d.free for d in found)
    if own.tensor_split:
        shares = (parse_tensor_split(own.tensor_split) + [0.0] * len(found))[: len(found)]
        total = sum(shares) or 1.0
        free = min((int(d.free * total / s) for d, s in zip(found, shares, strict=True) if s > 0), default=0)
    names = ", ".join(f"{d.name} ({d.description})" if d.description != d.name else d.name for d in found)
    return Device(",".join(d.name for d in found), names, free, sum(d.total for d in found), len(found))


def plan_offload(path: Path, settings: EngineSettings, device: Device | None) -> Offload:
    """The decision for the GGUF at `path` on `device` (None: a build without GPU offload): an explicit
    --n-gpu-layers as given, else the fit. Pure but for reading the GGUF's header."""
    asked = settings.llamacpp.n_gpu_layers
    where = (device.description or device.name) if device else None
    if device is None:
        why = "this llama.cpp build has no GPU backend"
        return Offload(0, 0, None, why if asked is None else f"--n-gpu-layers {asked} given, but {why}")
    info = read_gguf_info(path)
    shape = gguf_shape(info.metadata)
    if asked is not None:
        return Offload(ALL if asked < 0 else asked, shape.n_layer, where, f"--n-gpu-layers {asked} given")
    layers = [0] * shape.n_layer
    output = 0
    for t in info.tensors:
        m = _LAYER.match(t.name)
        if m and int(m.group(1)) < shape.n_layer:
            layers[int(m.group(1))] += t.n_bytes
        elif t.name.startswith("output"):  # output.weight and output_norm (the embeddings stay on the CPU)
            output += t.n_bytes
    if output == 0:  # tied embeddings: the output layer reads token_embd, which llama.cpp then copies over
        output = next((t.n_bytes for t in info.tensors if t.name == "token_embd.weight"), 0)
    kv_layer = layer_kv_bytes(shape, llamacpp_kv(shape, settings))
    vocab = len(info.metadata.get("tokenizer.ggml.tokens") or []) or 32000
    arch = info.metadata.get("general.architecture")
    n_embd = int(info.metadata.get(f"{arch}.embedding_length") or 4096)
    buffers = settings.n_batch * (vocab + 16 * n_embd) * 4  # logits plus activations of one batch, fp32
    n = fit_layers(layers, output, kv_layer, buffers, device.free, MARGIN * device.count)
    gib = 2**30
    total = (sum(layers) + output + kv_layer * shape.n_layer) / gib
    if n == ALL:
        reason = f"{total:.1f} GiB of weights and KV fit in {device.free / gib:.1f} GiB free"
    else:
        reason = f"{total:.1f} GiB of weights and KV; {device.free / gib:.1f} GiB free, 1 GiB kept free"
    return Offload(n, shape.n_layer, where, reason)
