"""The llama.cpp backend: its plan for a detected model (a GGUF as it is; an HF checkpoint after dequantizing and
in-situ conversion to GGUF) and the load that carries the plan out."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from quantserve.backends import facts
from quantserve.core.model_size import gguf_shape, llamacpp_kv, model_shape
from quantserve.core.plan import ModelPlan
from quantserve.core.runner import Loaded, ModelInfo
from quantserve.core.settings import EngineSettings
from quantserve.errors import BackendUnavailableError, ConfigError, ModelFileError
from quantserve.formats import ModelSpec, detect, find_mmproj, is_mmproj, read_gguf_info
from quantserve.formats.hf_config import is_llava
from quantserve.formats.mmproj import describe_mmproj

log = logging.getLogger("quantserve")


def _dequant_dtype(spec: ModelSpec) -> str:
    """fp32 for FP8 and FP4, whose weights times their scales fp16 cannot always hold (so the conversion starts
    from exactly the checkpoint's weights, as llama.cpp's converter does); fp16 for the integer schemes."""
    return "float32" if spec.scheme is not None and spec.scheme.float_weights else "float16"


def _dequantized(spec: ModelSpec) -> tuple[ModelSpec, object]:
    """A quantized HF checkpoint (GPTQ, AWQ, Marlin, compressed-tensors, FP8, FP4) as dense weights in a temporary
    directory (llama.cpp reads no such format); the handle keeps the directory alive while it is served."""
    import tempfile

    from quantserve.quant.dequantize import dequantize_checkpoint

    log.info("backend llamacpp: %s is %s; dequantizing it for conversion to GGUF", spec.path, spec.format)
    tmp = tempfile.TemporaryDirectory(prefix="quantserve-dequant-")
    dense = dequantize_checkpoint(
        spec.directory, Path(tmp.name) / spec.directory.name, dtype=_dequant_dtype(spec)
    )
    return detect(dense), tmp


def projector(gguf: Path, given: str | None) -> Path | None:
    """The vision projector to load with `gguf`: the one given (checked), else one found beside it, else None.

    Raises:
        ModelFileError: the given file is no valid mmproj GGUF (checked before libmtmd sees it).
    """
    if given is None:
        found = find_mmproj(gguf)
        if found is not None:
            log.info("vision projector %s found beside %s", found.name, gguf.name)
        return found
    path = Path(given).expanduser()
    if not path.is_file():
        raise ModelFileError(
            f"--mmproj {given}: no such file; give the mmproj GGUF `quantserve convert` wrote"
        )
    if not is_mmproj(read_gguf_info(path)):
        raise ModelFileError(
            f"--mmproj {given} is a GGUF but not a vision projector (no clip.has_vision_encoder); give the "
            "mmproj-*.gguf file"
        )
    return path


PROBE_STEP = (
    "probe: llama.cpp loads the GGUF and evaluates one token in a child process (once per file version; a pass "
    "is kept in the cache directory, where a later start finds it)"
)


def probe_store(settings: EngineSettings) -> Path | None:
    """Where passed probes are kept across processes: the cache directory's probes/ (none with --no-cache)."""
    if not settings.use_cache:
        return None
    from quantserve.insitu.cache import default_cache_dir

    root = Path(settings.cache_dir).expanduser() if settings.cache_dir else default_cache_dir()
    return root / "probes"


class LlamaCppBackend:
    """llama.cpp through llama-cpp-python: GGUF on the CPU, Metal or CUDA. Its plan imports neither llama.cpp
    nor torch."""

    name = "llamacpp"

    def plan(self, spec: ModelSpec, settings: EngineSettings, reason: str) -> ModelPlan:
        """What load() will do with `spec`, from headers only.

        Raises:
            BackendUnavailableError: a format llama.cpp cannot read, even after conversion.
            ConfigError: --quant on a GGUF of another type; a bad --chat-template file.
            ModelFileError: a malformed GGUF or projector.
        """
        if spec.format == "gguf":
            return self._plan_gguf(spec, settings, reason)
        if spec.format != "safetensors" and spec.scheme is None:
            raise BackendUnavailableError(
                f"{spec.path} is a {spec.format} checkpoint, which llama.cpp cannot read; serve it with "
                "--backend torch"
            )
        from quantserve.insitu import target_type

        steps = []
        quant = settings.quant
        if spec.scheme is not None:
            dtype = "exactly to fp32" if _dequant_dtype(spec) == "float32" else "to fp16"
            steps.append(f"dequantize the {spec.scheme.summary()} weights {dtype}, in a temporary directory")
            quant = quant or "q8_0"  # 4-bit values and FP8 need no more than 8 bits to stay (nearly) exact
        where = (
            "kept in the in-situ cache, where a later start finds it"
            if settings.use_cache
            else "a temporary file"
        )
        _refuse_without_imatrix(spec, quant)
        steps.append(f"convert to GGUF {target_type(spec, quant)} ({where})")
        llava = is_llava(spec.config)
        if llava:
            steps.append("write the vision projector (mmproj) beside it, for libmtmd")
        steps += [PROBE_STEP, "load it with llama.cpp (GPU layers fitted to the converted file)"]
        shape = model_shape(spec)
        kv = llamacpp_kv(shape, settings) if shape is not None else None
        vision = "LLaVA, through the projector written at conversion (libmtmd)" if llava else None
        return facts.make_plan(
            spec, settings, (self.name, reason), tuple(steps), kv, quant=quant, vision=vision
        )

    def _plan_gguf(self, spec: ModelSpec, settings: EngineSettings, reason: str) -> ModelPlan:
        info = read_gguf_info(spec.files[0])
        for part in spec.files[1:]:
            read_gguf_info(part)
        file_type = str(spec.quant.get("file_type", ""))
        if is_mmproj(info):
            why = (
                "a vision projector for libmtmd, not a model: serve its LLaVA text GGUF with it (beside it, or as "
                "`mmproj` in models.toml)"
            )
            vision = f"vision projector (mmproj): {describe_mmproj(info)}"
            plan = facts.make_plan(spec, settings, (self.name, why), (), None, architecture=info.architecture,
                                   vision=vision)  # fmt: skip
            return replace(plan, template=None, tool_format=None, capabilities=())
        if settings.quant and settings.quant.lower() != file_type.lower():
            raise ConfigError(
                f"{spec.path} is already a {file_type} GGUF; --quant {settings.quant} applies to dense "
                "checkpoints. Requantize offline with `quantserve convert`, or drop --quant",
                param="quant",
            )
        mmproj = projector(spec.files[0], settings.llamacpp.mmproj)
        rank = info.rank_outputs
        kv = llamacpp_kv(gguf_shape(info.metadata), settings, n_ctx_cap=info.context_length if rank else None)
        from quantserve.backends.llamacpp.offload import gpu_device, plan_offload

        if settings.llamacpp.rpc:  # a plan reads headers only: the workers are greeted at load
            load = (
                f"load it with llama.cpp, its layers on RPC workers {settings.llamacpp.rpc} as their free memory "
                f"and --tensor-split say ({settings.llamacpp.split_mode} split); the token embeddings stay here"
            )
        else:
            load = f"load it with llama.cpp: {plan_offload(spec.files[0], settings, gpu_device(settings.llamacpp)).describe()}"
        vision = None
        if mmproj is not None:
            vision = f"images through {mmproj.name}: {describe_mmproj(read_gguf_info(mmproj))}"
            load += f"; images through {mmproj.name} (libmtmd)"
        steps: tuple[str, ...] = (PROBE_STEP, load)
        if (window := info.metadata.get(f"{info.architecture}.attention.sliding_window")) and not (
            settings.llamacpp.swa_full
        ):
            steps += (
                f"sliding-window layers keep each sequence's last {window} positions (plus a batch; --swa-full "
                "keeps all): the KV above counts every layer at full context, an upper bound; a cached prefix is "
                "reused by a prompt that continues all of it",
            )
        if rank:
            steps += (
                f"a classification head of {rank} output(s): rank pooling for /v1/rerank, no generation",
            )
        return facts.make_plan(spec, settings, (self.name, reason), steps, kv, architecture=info.architecture,
                               vision=vision, mmproj=mmproj, rank_outputs=rank)  # fmt: skip

    def check(self, plan: ModelPlan) -> None:
        """What can fail before memory is spent: a GGUF loaded as it is gets its probe (cached). A router runs
        this before it unloads other models to make room."""
        if plan.spec.format == "gguf" and plan.kv is not None:
            from quantserve.backends.llamacpp.probe import PROBES

            PROBES.check(plan.spec.files[0], plan.mmproj, store=probe_store(plan.settings))

    def load(self, plan: ModelPlan) -> Loaded:
        """Carry out `plan`: convert if it says so, probe the GGUF in a child, then load it in this process.

        Raises:
            ModelFileError: the probe's child refused the file or died on it; llama.cpp could not load it.
        """
        spec, settings, keep_alive = plan.spec, plan.settings, None
        if plan.kv is None:
            raise ModelFileError(f"{spec.path}: {plan.reason}")
        if spec.format != "gguf":
            gguf_path, keep_alive = self._convert(plan)
            mmproj = projector(gguf_path, settings.llamacpp.mmproj)
        else:
            gguf_path, mmproj = spec.files[0], plan.mmproj
        from quantserve.backends.llamacpp.probe import PROBES

        PROBES.check(gguf_path, mmproj, store=probe_store(settings))
        info = read_gguf_info(gguf_path)
        log.info("backend llamacpp: %s is GGUF (%s, %s)", gguf_path.name, info.architecture, info.file_type)
        if info.rank_outputs:
            log.info(
                "%s has a classification head (%d output(s)): served as a reranker on /v1/rerank, not for "
                "generation",
                gguf_path.name,
                info.rank_outputs,
            )
        from quantserve.backends.llamacpp.model import LlamaCppRunner

        runner = LlamaCppRunner(gguf_path, settings, plan.kv, mmproj=mmproj, rank_outputs=info.rank_outputs)
        return Loaded(
            runner=runner,
            info=ModelInfo(
                architecture=info.architecture, n_params=info.n_params, format="gguf", backend=self.name
            ),
            bos_token=runner.special_text(runner.bos_token),
            eos_token=runner.special_text(runner.eos_token),
            keep_alive=keep_alive,
        )

    def _convert(self, plan: ModelPlan) -> tuple[Path, object]:
        """The plan's conversion steps: an HF checkpoint (dequantized first if quantized) to a GGUF."""
        from quantserve.insitu import ensure_gguf

        spec, settings, keep_alive = plan.spec, plan.settings, None
        quant = settings.quant
        if spec.scheme is not None:
            spec, keep_alive = _dequantized(spec)
            quant = quant or "q8_0"
        log.info(
            "backend llamacpp: %s is a dense %s checkpoint; llama.cpp serves it after conversion to GGUF (%s)",
            spec.path,
            spec.quant.get("dtype", "?"),
            quant or "same precision",
        )
        gguf_file, handle = ensure_gguf(
            spec, quant, cache_dir=settings.cache_dir, use_cache=settings.use_cache
        )
        if keep_alive is not None and handle is None:
            keep_alive.cleanup()  # the GGUF is in the cache; the dequantized copy is no longer needed
        return gguf_file, handle or keep_alive


def _refuse_without_imatrix(spec: ModelSpec, quant: str | None) -> None:
    """A conversion at load computes no importance matrix, and the lowest i-quants need one (llama.cpp refuses
    them without): say so before anything is converted. An unknown type is left to the conversion's own error."""
    from quantserve.gguf.quant_types import parse_quant

    try:
        target = parse_quant(quant) if quant else None
    except ConfigError:
        return
    if target is not None and target.needs_imatrix:
        raise ConfigError(
            f"--quant {target.name} needs an importance matrix, which a conversion at load does not compute; make "
            f"the file once with `quantserve convert --src {spec.path} --dst model.{target.name}.gguf --quant "
            f"{target.name} --calib builtin` and run that, or convert at load to a type that needs none (iq4_xs, "
            "q4_k_m)",
            param="quant",
        )
