"""Where calibration tokens come from: the built-in text, a text file, a Hugging Face dataset, or the model itself.

Every source ends as int64 [n_samples, seq_len] token ids from the model's own tokenizer.json. `--calib self` is
data-free calibration as in LLM-QAT (Liu et al. 2023): each sample starts from one random vocabulary token, the
model continues it greedily for a few tokens (so that it settles on a topic) and then by plain sampling at
temperature 1, the distribution it was trained to reproduce. It needs no file and no network.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from quantserve.converters.calibration.driver import calibration_tokens
from quantserve.errors import ConfigError

log = logging.getLogger(__name__)

GREEDY_TOKENS = 4  # LLM-QAT's hybrid: the first few tokens greedy, then sampled


@dataclass(frozen=True)
class Calibration:
    tokens: torch.Tensor  # int64 [n_samples, seq_len]
    source: str  # how it was made, for logs and reports


def calibration_set(
    src: str | Path,
    calib: str | None = None,
    *,
    dataset: str | None = None,
    n_samples: int,
    seq_len: int,
    seed: int = 0,
    progress: bool = True,
) -> Calibration:
    """Calibration tokens for the dense checkpoint `src`.

    Args:
        calib: None or "builtin" (the built-in text), "self" (the model's own samples) or a UTF-8 text file.
        dataset: a Hugging Face dataset name (ORG/NAME, or any name `datasets.load_dataset` takes); its train
            split's text column is read until n_samples x seq_len tokens are had. Excludes `calib`.

    Raises:
        ConfigError: both sources given, a file that is not there or not text, a dataset that cannot be read.
    """
    if dataset and calib not in (None, "builtin"):
        raise ConfigError("pass either --calib or --calib-dataset, not both", param="calib")
    if dataset:
        text = _dataset_text(dataset, n_samples * seq_len * 6)  # ~4 bytes a token, with a margin
        return Calibration(calibration_tokens(src, text, n_samples, seq_len), f"dataset {dataset}")
    if calib in (None, "builtin"):
        t = calibration_tokens(src, None, n_samples, seq_len)
        return Calibration(t, "the built-in text")
    if calib == "self":
        return Calibration(
            self_generated(src, n_samples, seq_len, seed=seed, progress=progress),
            f"self-generated (seed {seed})",
        )
    path = Path(calib)
    if not path.is_file():
        raise ConfigError(
            f"--calib {calib}: no such file; pass a UTF-8 text file, 'self' or 'builtin'", param="calib"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"--calib {calib}: cannot read it as UTF-8 text ({exc})", param="calib") from exc
    return Calibration(calibration_tokens(src, text, n_samples, seq_len), f"file {path.name}")


def self_generated(
    src: str | Path, n_samples: int, seq_len: int, *, seed: int = 0, progress: bool = True
) -> torch.Tensor:
    """n_samples sequences of seq_len tokens sampled from the model at `src` (any format quantserve serves),
    each from a random non-special first token; int64 [n_samples, seq_len]. Reproducible for a seed, up to near
    ties where the batch's numerics differ from a single sequence's (llama.cpp on CPUs without AVX-512)."""
    from quantserve.core.sampling_params import SamplingParams
    from quantserve.llm import load

    if seq_len <= GREEDY_TOKENS + 1:
        raise ConfigError(f"--calib-seq-len must exceed {GREEDY_TOKENS + 1} for --calib self")
    parallel = min(n_samples, 16)
    llm = load(str(src), ctx_size=seq_len, max_num_seqs=parallel, prefix_cache=False)
    try:
        rng = random.Random(seed)
        special = _special_ids(Path(src))
        pool = [t for t in range(llm.n_vocab) if t not in special]
        starts = [rng.choice(pool) for _ in range(n_samples)]
        bar = tqdm(total=n_samples * seq_len, desc="calibration (self)", unit="tok", disable=not progress)

        async def one(i: int) -> list[int]:
            ids = [starts[i]]
            bar.update(1)
            for params in (
                SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=seq_len - 1 - GREEDY_TOKENS, temperature=1.0, seed=seed * 100003 + i,
                               ignore_eos=True),
            ):  # fmt: skip
                async for out in llm.generate(list(ids), params):
                    ids += out.token_ids
                    bar.update(len(out.token_ids))
            return ids

        async def run() -> list[list[int]]:
            sem = asyncio.Semaphore(parallel)

            async def bounded(i: int) -> list[int]:
                async with sem:
                    return await one(i)

            return await asyncio.gather(*(bounded(i) for i in range(n_samples)))

        samples = asyncio.run(run())
        bar.close()
    finally:
        llm.close()
    bad = [len(s) for s in samples if len(s) != seq_len]
    if bad:
        raise ConfigError(
            f"self-generation gave {bad[0]} tokens where {seq_len} were asked; lower --calib-seq-len"
        )
    log.info("calibration: %d self-generated samples of %d tokens", n_samples, seq_len)
    return torch.tensor(samples, dtype=torch.long)


def _special_ids(src: Path) -> set[int]:
    """Token ids of tokenizer.json's added special tokens (never a sample's random start)."""
    import json

    path = src / "tokenizer.json" if src.is_dir() else None
    if path is None or not path.is_file():
        return set()
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    return {int(t["id"]) for t in added if t.get("special", True)}


def _dataset_text(name: str, min_chars: int) -> str:
    """Text from a Hugging Face dataset's train split: the first string column, streamed until min_chars."""
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(
            "--calib-dataset needs the `datasets` package (pip install 'quantserve[datasets]') and access to the "
            "Hugging Face Hub; offline, use --calib FILE or --calib self",
            param="calib_dataset",
        ) from exc
    org_name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(org_name, config or None, split="train", streaming=True)
        parts: list[str] = []
        size = 0
        for row in ds:
            text = next((v for v in row.values() if isinstance(v, str) and v.strip()), None)
            if text:
                parts.append(text)
                size += len(text)
                if size >= min_chars:
                    break
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (network, missing config, schema)
        raise ConfigError(
            f"--calib-dataset {name}: could not read its train split ({type(exc).__name__}: {exc}); offline, "
            "use --calib FILE or --calib self",
            param="calib_dataset",
        ) from exc
    if not parts:
        raise ConfigError(
            f"--calib-dataset {name}: its train split has no text column", param="calib_dataset"
        )
    return "\n\n".join(parts)
