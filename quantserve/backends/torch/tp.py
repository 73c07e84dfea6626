"""Tensor parallel across processes: rank 0 is the server, and ranks 1..N-1 are processes it starts on this machine.

Rank 0 owns the scheduler, the KV ledger, the sampler and the HTTP server, as vLLM's driver does. Each step it
broadcasts the step's plan (per sequence: where its new tokens start, how many, the sequence's length, the tokens
and the block table; a few hundred int64s) over a gloo group, and every rank runs the same forward on its slice of
the model (tp_shard.py). The all-reduces inside the model use NCCL on CUDA and gloo on the CPU. Only rank 0
samples; the others compute their share of the logits for the gather and drop them.

A rank that dies makes the next collective fail on rank 0 (gloo and NCCL see the closed connection; the group's
timeout bounds the rest). The runner then refuses every later step with a 503 that names the rank, its pid and how
it ended, and the server's /readyz says the same: the model is gone until the server restarts.

    python -m quantserve.backends.torch.tp   # a rank >= 1; its orders are in $QUANTSERVE_TP (JSON)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from quantserve.backends.torch.tp_shard import TensorParallel
from quantserve.errors import ModelUnavailableError

log = logging.getLogger("quantserve.torch")

ENV = "QUANTSERVE_TP"
STOP, STEP, EMBED, SCORE = 0, 1, 2, 3
TIMEOUT = timedelta(seconds=60)  # the longest a collective waits for a rank that neither answers nor closes


class RankLostError(ModelUnavailableError):
    """A tensor-parallel rank is gone: 503 (the server is up, the model is not)."""


@dataclass
class _Seq:
    """A sequence as another rank needs it for one step (what backends/torch/step.prepare_step reads)."""

    tokens: list[int]
    num_computed: int
    block_table: list[int]
    images: tuple = ()


def encode_plan(plan: list[tuple[Any, int]], block_size: int) -> torch.Tensor:
    """[n, then per sequence: start, n, length, blocks, its n tokens, its blocks] as int64."""
    out = [len(plan)]
    for seq, n in plan:
        start = seq.num_computed
        blocks = seq.block_table[: -(-(start + n) // block_size)]
        out += [start, n, len(seq.tokens), len(blocks), *seq.tokens[start : start + n], *blocks]
    return torch.tensor(out, dtype=torch.int64)


def decode_plan(t: torch.Tensor) -> list[tuple[_Seq, int]]:
    v = t.tolist()
    plan, i = [], 1
    for _ in range(v[0]):
        start, n, length, nb = v[i : i + 4]
        i += 4
        tokens = [0] * length
        tokens[start : start + n] = v[i : i + n]
        i += n
        plan.append((_Seq(tokens, start, v[i : i + nb]), n))
        i += nb
    return plan


@dataclass
class Group:
    """The ranks as rank 0 sees them: the control group, and the other ranks' processes (None: not started here,
    as under torchrun)."""

    tp: TensorParallel
    control: Any  # a gloo group for the orders, whatever the compute backend
    procs: list[subprocess.Popen] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # each rank's last step
    total_seconds: list[float] = field(default_factory=list)

    def send(self, cmd: int, payload: torch.Tensor | None = None, extra: int = 0) -> None:
        import torch.distributed as dist

        payload = torch.zeros(0, dtype=torch.int64) if payload is None else payload
        dist.broadcast(torch.tensor([cmd, payload.numel(), extra]), src=0, group=self.control)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.control)

    def loaded(self) -> None:
        """Wait until every rank has loaded its slice.

        Raises:
            RankLostError: a rank failed to load (its own log says why) or died.
        """
        import torch.distributed as dist

        try:
            dist.barrier(group=self.control)
        except RuntimeError as exc:
            time.sleep(0.5)
            raise RankLostError(
                f"{self.gone() or 'a tensor-parallel rank'} while loading its slice of the model (its log above "
                f"says why): {exc}"
            ) from None

    def abandon(self) -> None:
        """A load that failed: the other ranks stop, and this process can start a group again."""
        import torch.distributed as dist

        for p in self.procs:
            p.kill()
            p.wait()
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()

    def gone(self) -> str | None:
        """Which rank's process has ended, and how; None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            if (rc := proc.poll()) is not None:
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, addr: str, port: int, device: torch.device) -> tuple[TensorParallel, Any]:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else None
    return TensorParallel(rank, world), control


def start_group(spec_path: Path, settings, device: torch.device) -> Group:
    """Start ranks 1..N-1 on this machine and join them as rank 0; they load their slices meanwhile."""
    world = settings.torch.tensor_parallel_size
    port = _free_port()
    orders = {"spec": str(spec_path), "settings": dataclasses.asdict(settings), "world": world,
              "addr": "127.0.0.1", "port": port}  # fmt: skip
    procs = []
    for rank in range(1, world):
        env = {**os.environ, ENV: json.dumps({**orders, "rank": rank})}
        if device.type == "cuda":
            env.setdefault("LOCAL_RANK", str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "quantserve.backends.torch.tp"], env=env))
    try:
        tp, control = _init(0, world, "127.0.0.1", port, device)
    except Exception:
        for p in procs:
            p.kill()
        raise
    log.info("tensor parallel: %d ranks (%s), ranks 1-%d are pids %s", world,
             "NCCL" if device.type == "cuda" else "gloo", world - 1, ", ".join(str(p.pid) for p in procs))  # fmt: skip
    return Group(tp, control, procs, [0.0] * world, [0.0] * world)


class TPRunner:
    """Rank 0's runner: the TorchRunner of its own slice, with every forward announced to the other ranks first.
    Forwards are serialised (the engine's steps and /v1/embeddings' own forwards would otherwise interleave their
    collectives)."""

    def __init__(self, inner, group: Group):
        self.inner, self.group = inner, group
        self._lock = threading.Lock()
        self._fault: str | None = None

    def __getattr__(self, name: str):  # tokenizer, kv_spec, n_ctx, ...: the inner runner's
        return getattr(self.inner, name)

    def fault(self) -> str | None:
        """Why the model cannot run any more (a rank is gone), or None."""
        if self._fault is None and (gone := self.group.gone()):
            self._fault = gone
        return self._fault

    def _run(self, cmd: int, payload: torch.Tensor | None, extra: int, fn):
        with self._lock:
            if self.fault():
                raise RankLostError(f"the model is unavailable: {self._fault}; restart the server")
            t0 = time.perf_counter()
            try:
                self.group.send(cmd, payload, extra)
                out = fn()
                if cmd == STEP:
                    self._gather_times(time.perf_counter() - t0)
                return out
            except RuntimeError as exc:  # a collective failed: a rank is gone or unreachable
                time.sleep(0.5)  # let a dead rank's exit be seen, to name it
                self._fault = self.group.gone() or f"a tensor-parallel collective failed: {exc}"
                log.error("tensor parallel: %s", self._fault)
                raise RankLostError(f"the model is unavailable: {self._fault}; restart the server") from exc

    def _gather_times(self, seconds: float) -> None:
        import torch.distributed as dist

        times = [torch.zeros(1, dtype=torch.float64) for _ in range(self.group.tp.world)]
        dist.all_gather(times, torch.tensor([seconds], dtype=torch.float64), group=self.group.control)
        for rank, t in enumerate(times):
            self.group.step_seconds[rank] = float(t)
            self.group.total_seconds[rank] += float(t)

    def rank_step_seconds(self) -> list[tuple[float, float]]:
        """(last step, all steps) in seconds, per rank, for /metrics and `quantserve bench`."""
        return list(zip(self.group.step_seconds, self.group.total_seconds, strict=True))

    def execute(self, plan):
        payload = encode_plan(plan, self.inner.block_size)
        return self._run(STEP, payload, 0, lambda: self.inner.execute(plan))

    def embed(self, tokens: list[int]) -> list[float]:
        return self._run(EMBED, torch.tensor(tokens), 0, lambda: self.inner.embed(tokens))

    def score(self, tokens: list[int], first: int):
        return self._run(SCORE, torch.tensor(tokens), first, lambda: self.inner.score(tokens, first))

    def close(self) -> None:
        import torch.distributed as dist

        with self._lock:
            if not self.fault():
                with contextlib.suppress(RuntimeError):
                    self.group.send(STOP)
            for p in self.group.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()
        self.inner.close()


def serve_rank(runner, group_control: Any) -> None:
    """Ranks >= 1: run rank 0's orders until it says stop (or is gone, which fails the next broadcast)."""
    import torch.distributed as dist

    while True:
        head = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(head, src=0, group=group_control)
        cmd, size, extra = head.tolist()
        payload = torch.zeros(size, dtype=torch.int64)
        if size:
            dist.broadcast(payload, src=0, group=group_control)
        if cmd == STOP:
            return
        t0 = time.perf_counter()
        if cmd == STEP:
            runner.execute(decode_plan(payload))
            seconds = time.perf_counter() - t0
            times = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
            dist.all_gather(times, torch.tensor([seconds], dtype=torch.float64), group=group_control)
        elif cmd == EMBED:
            runner.embed(payload.tolist())
        elif cmd == SCORE:
            runner.score(payload.tolist(), extra)


def _watch_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def rank_main() -> int:
    """A rank >= 1, started by rank 0 (start_group)."""
    import torch.distributed as dist

    from quantserve.backends.torch.backend import load_slice
    from quantserve.core.settings import EngineSettings, LlamaCppSettings, TorchSettings
    from quantserve.formats import detect

    orders = json.loads(os.environ[ENV])
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {orders['rank']} %(levelname)-7s %(message)s"
    )
    _watch_parent()
    raw = orders["settings"]
    settings = EngineSettings(
        **{k: v for k, v in raw.items() if k not in ("llamacpp", "torch")},
        llamacpp=LlamaCppSettings(**raw["llamacpp"]),
        torch=TorchSettings(**raw["torch"]),
    )
    spec = detect(Path(orders["spec"]))
    device, _ = _device(spec, orders["rank"])
    tp, control = _init(orders["rank"], orders["world"], orders["addr"], orders["port"], device)
    runner = load_slice(spec, settings, tp, device)
    dist.barrier(group=control)  # loaded: rank 0 waits for this
    try:
        serve_rank(runner, control)
    except RuntimeError as exc:  # rank 0 is gone
        log.info("rank 0 is gone (%s); stopping", exc)
    return 0


def _device(spec, rank: int) -> tuple[torch.device, torch.dtype]:
    from quantserve.backends.torch.backend import pick_device_dtype

    device, dtype = pick_device_dtype(spec.config or {})
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device, dtype


if __name__ == "__main__":
    sys.exit(rank_main())
