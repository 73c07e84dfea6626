"""Probe a GGUF in a child process before llama.cpp loads it in this one: an abort in C kills only the child.

Our validator (quantserve.formats.gguf) refuses the malformed files it knows of, but llama.cpp has hundreds of
GGML_ASSERTs, and one that fires calls abort(), which no Python code can catch: in a server it would take down
every model. So the child loads the file exactly as LlamaCppRunner does, tokenizes a little text and evaluates one
token through the real decode path, or for a reranker one pair through its head (some asserts fire only when the
compute graph is built); the parent turns a child killed by a signal into a ModelFileError. A probe costs one
extra load, so results are cached per file version: in the process, and a pass also on disk (under the cache
directory's probes/, keyed by the file's identity and the llama.cpp build), so that a restart of the server on a
large GGUF does not load it twice.

The child runs on the CPU with llama.cpp's default context settings (a 64-cell context, no GPU layers): an abort
that only a GPU backend, flash attention or a quantized KV cache would trigger is not found here, and one the CPU
backend hits but a GPU would not (a norm weight in F16) refuses the file everywhere.

    python -m quantserve.backends.llamacpp.probe MODEL.gguf [--mmproj MMPROJ.gguf]   # the child; exit 0 or 2
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from quantserve.errors import ModelFileError, ModelNotFoundError

log = logging.getLogger("quantserve")

PROBE_CTX = 64  # KV cells: one token is evaluated, and a small context keeps the child's memory small
SAMPLE_TEXT = "Hello, world!\n 123"  # spaces, punctuation, digits and a newline go through the tokenizer
# ggml_abort's line, which GGML_ASSERT and GGML_ABORT print before abort(): "/path/to/ggml.c:4014: message"
_GGML_ABORT = re.compile(r"^\S*?([\w.-]+\.(?:c|cpp|h|cu|m):\d+: .*)")
# other lines of the child's stderr that name a cause, best first (else its last line)
_TELLING = ("what():", "error")
_FIX = "convert the model again or download it again"


class ProbeCrashError(ModelFileError):
    """The probe process died: killed by a signal (llama.cpp aborting), an unexpected exit code, or a timeout.

    A ModelFileError to the server; `returncode` (negative: the signal; None: timed out) and `detail` (the most
    telling line of the child's stderr) are for tools that tell crashes from clean refusals."""

    def __init__(self, message: str, *, returncode: int | None, detail: str):
        super().__init__(message)
        self.returncode = returncode
        self.detail = detail


def probe_gguf(path: Path, *, mmproj: Path | None = None, timeout: float = 300.0) -> float:
    """Load `path` with llama.cpp in a child process and evaluate one token there.

    Args:
        path: the GGUF model file.
        mmproj: its vision projector, loaded too when given.
        timeout: seconds before the child is killed and the file refused.
    Returns:
        The child's wall time in seconds.
    Raises:
        ModelFileError: the validator or llama.cpp refused the file (the child's own message).
        ProbeCrashError: the child was killed by a signal, exited otherwise, or timed out.
    """
    path = Path(path)
    cmd = [sys.executable, "-P", "-m", __name__, str(path)]  # -P: nothing from the working directory
    if mmproj is not None:
        cmd += ["--mmproj", str(mmproj)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ProbeCrashError(
            f"{path}: loading it with llama.cpp and evaluating one token took longer than {timeout:g} s in a "
            "probe process, so it was not loaded here; the file may be too large for this machine (or the disk too "
            f"slow: the next request tries again), or llama.cpp hangs on it ({_FIX})",
            returncode=None,
            detail="",
        ) from None
    seconds = time.perf_counter() - t0
    if r.returncode == 0:
        log.info(
            "probe of %s: loaded and evaluated one token in a child process in %.2f s", path.name, seconds
        )
        return seconds
    if r.returncode == 2:
        raise ModelFileError(_error_line(r.stderr) or f"{path}: refused by the probe process")
    if r.returncode < 0:
        try:
            how = f"killed by {signal.Signals(-r.returncode).name}"
        except ValueError:
            how = f"killed by signal {-r.returncode}"
    else:
        how = f"exited with code {r.returncode}"
    detail = telling_line(r.stderr)
    raise ProbeCrashError(
        f"{path}: llama.cpp {how} while loading it and evaluating one token in a probe process "
        f"({detail or 'no message'}); loaded in the server, it would have killed the server. The file passed "
        f"quantserve's checks but this llama.cpp build cannot run it; {_FIX}",
        returncode=r.returncode,
        detail=detail,
    )


def _error_line(stderr: str) -> str:
    """The child's own message: from its last line that starts with 'error: ' to the end (the child's last words)."""
    at = ("\n" + stderr).rfind("\nerror: ")
    return stderr[at + len("error: ") :].strip() if at >= 0 else ""


def telling_line(stderr: str) -> str:
    """The line of a dead child's stderr that best says why: llama.cpp's assert, an uncaught C++ exception, an
    error it logged, or else the last line; source paths shortened to the file name."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if m := _GGML_ABORT.match(ln):
            return m.group(1)[:500]
    for word in _TELLING:
        hit = next((ln for ln in lines if word in ln), None)
        if hit is not None:
            return hit[:500]
    return lines[-1][:500] if lines else ""


class ProbeCache:
    """probe_gguf once per file version: (resolved path, size, mtime, ctime, inode), and the projector's likewise.

    What the file itself decides is remembered: a clean refusal, or llama.cpp aborting on it (SIGABRT, SIGSEGV, …),
    so a broken file is not probed again on every request; a changed file (new bytes: a new ctime, whatever its
    size and mtime say) is probed afresh. A timeout, a kill (the OOM killer's SIGKILL) or another exit code may
    pass, and is probed again next time. Passes are also kept in `store` when a check names one (see
    `_DiskEntry`), so that another process skips the probe too. Thread-safe: probes of different files run at
    once, of the same file once."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._results: dict[tuple, ModelFileError | None] = {}  # key -> None (ok) or the probe's error
        self._key_locks: dict[tuple, threading.Lock] = {}

    def check(self, path: Path, mmproj: Path | None = None, *, store: Path | None = None) -> None:
        """Return if the file probes ok (now, before, or in another process that kept its pass in `store`);
        raise ModelFileError if it did not."""
        key = (_version(path), _version(mmproj) if mmproj is not None else None)
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # a second caller for the same file waits for the first's probe and reads its result
            if key not in self._results:
                disk = _DiskEntry(store, key) if store is not None else None
                if disk is not None and disk.passed():
                    log.info("probe of %s: passed before with this llama.cpp build (%s); not probed again",
                             Path(path).name, disk.path)  # fmt: skip
                    self._results[key] = None
                else:
                    try:
                        seconds = probe_gguf(path, mmproj=mmproj, timeout=self.timeout)
                        self._results[key] = None
                    except ModelFileError as exc:
                        if not _lasting(exc):
                            raise
                        self._results[key] = exc
                    else:
                        if disk is not None:
                            disk.keep(seconds)
            error = self._results[key]
        if error is not None:
            raise error.with_traceback(None)  # the same error again, without the tracebacks of earlier raises


class _DiskEntry:
    """A passed probe on disk: `<store>/<hash>.json`, holding the key it was written for.

    The key is what the pass depends on: each file's identity (resolved path, size, mtime, ctime and inode: an
    in-place rewrite changes the ctime) and the llama.cpp build that probed it (llama-cpp-python's version and its
    shared libraries' sizes and times), so a new file version or a rebuilt llama.cpp probes again. An entry is
    trusted only if it parses and holds exactly that key; anything else (a torn write, a hand edit, another key)
    is ignored and written anew after the next pass. Only passes are kept: a failure stays the process's own."""

    def __init__(self, store: Path, key: tuple):
        self.key = {"files": [list(v) if v else None for v in key], "llama.cpp": _llama_cpp_build()}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:32]
        self.path = Path(store) / f"{digest}.json"

    def passed(self) -> bool:
        try:
            entry = json.loads(self.path.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            log.warning("probe cache entry %s is unreadable (%s); probing again", self.path, exc)
            return False
        if not isinstance(entry, dict) or entry.get("key") != self.key or entry.get("passed") is not True:
            log.warning("probe cache entry %s does not hold this file's key; probing again", self.path)
            return False
        return True

    def keep(self, seconds: float) -> None:
        """Write the pass (atomically: a reader sees the old entry or the whole new one); a failure to write only
        costs a probe next time."""
        entry = {"key": self.key, "passed": True, "seconds": round(seconds, 3), "at": time.time()}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not keep the probe's pass in %s (%s)", self.path, exc)
            tmp.unlink(missing_ok=True)


@functools.cache
def _llama_cpp_build() -> str:
    """Which llama.cpp build a probe ran: llama-cpp-python's version and its shared libraries (name, size, mtime),
    found without importing it (the parent side stays cheap)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    version = importlib.metadata.version("llama_cpp_python")
    libs = []
    for loc in spec.submodule_search_locations:
        for lib in sorted(Path(loc, "lib").glob("*")):
            st = lib.stat()
            libs.append(f"{lib.name} {st.st_size} {st.st_mtime_ns}")
    return f"{version} " + hashlib.sha256("\n".join(libs).encode()).hexdigest()[:16]


# Signals that say the file is the problem (llama.cpp aborting or reading out of bounds), not the machine.
_FILE_SIGNALS = {-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS, -signal.SIGFPE, -signal.SIGILL}


def _lasting(exc: ModelFileError) -> bool:
    """Whether a probe's failure follows from the file alone, so that probing the same file again is pointless."""
    return not isinstance(exc, ProbeCrashError) or exc.returncode in _FILE_SIGNALS


def _version(path: Path) -> tuple[str, int, int, int, int]:
    path = Path(path).resolve()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path}: no such file") from None
    return str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


PROBES = ProbeCache()  # the process's cache: the loader checks every GGUF here before loading it


def _child(argv: list[str]) -> int:
    # Imported here: the parent side above must stay cheap to import (no llama.cpp).
    from quantserve.backends.llamacpp.model import LlamaCppRunner
    from quantserve.core.detokenizer import IncrementalDetokenizer
    from quantserve.core.sampling_params import SamplingParams
    from quantserve.core.sequence import Sequence
    from quantserve.core.settings import EngineSettings
    from quantserve.errors import QuantserveError
    from quantserve.formats import read_gguf_info

    ap = argparse.ArgumentParser(prog="python -m quantserve.backends.llamacpp.probe")
    ap.add_argument("path", type=Path)
    ap.add_argument("--mmproj", type=Path)
    args = ap.parse_args(argv)
    try:
        info = read_gguf_info(args.path)
        settings = EngineSettings(ctx_size=PROBE_CTX, n_batch=PROBE_CTX, max_num_seqs=1, threads=1)
        runner = LlamaCppRunner(args.path, settings, mmproj=args.mmproj, rank_outputs=info.rank_outputs)
        try:
            if runner.rank_outputs:  # a reranker: one pair (its first PROBE_CTX tokens) through its head
                (pair,) = runner.pair_inputs(SAMPLE_TEXT, [SAMPLE_TEXT])
                runner.rank([pair[:PROBE_CTX]])
                return 0
            tokens = runner.tokenize(SAMPLE_TEXT, add_special=True, parse_special=True) or [0]
            seq = Sequence(
                "probe",
                tokens[:1],
                SamplingParams(max_tokens=1, temperature=0.0),
                IncrementalDetokenizer(),
                max_total_tokens=PROBE_CTX,
            )
            seq.block_table = [0]  # slot 0, the one sequence
            (out,) = runner.execute([(seq, 1)])
            runner.token_bytes(out.token)
        finally:
            runner.close()
    except QuantserveError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # llama_decode's return code, from LlamaCppRunner.execute
        print(
            f"error: {args.path}: llama.cpp loaded the file but could not evaluate a token ({exc}); {_FIX}",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
