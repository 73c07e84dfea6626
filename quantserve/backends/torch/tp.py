"""Tensor parallel across processes: rank 0 is the server, and ranks 1..N-1 are processes it starts on this machine.

Rank 0 owns the scheduler, the KV ledger, the sampler and the HTTP server, as vLLM's driver does. Each step it
broadcasts the step's plan (per sequence: where its new tokens start, how many, the sequence's length, the tokens
and the block table; a few hundred int64s) over a gloo group, and every rank runs the same forward on its slice of
the model (tp_shard.py). The all-reduces inside the model use NCCL on CUDA and gloo on the CPU. Only rank 0
samples; the others compute their share of the logits for the gather and drop them.

The orders travel on a gloo group of their own, whose timeout is a year: ranks >= 1 wait there between requests,
however idle the server. The forward's collectives keep a short one (TIMEOUT). A rank that dies makes the next
collective fail on rank 0 (gloo sees the closed connection; on CUDA, NCCL's blocking wait bounds it by TIMEOUT). The
runner then refuses every later step with a 503 that names the rank, its pid and how it ended, and the server's
/readyz says the same: the model is gone until the server restarts.

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
from quantserve.core.lifeline import exit_with_parent
from quantserve.core.runner import RunnerBase
from quantserve.errors import ConfigError, InvalidRequestError, ModelUnavailableError

log = logging.getLogger("quantserve.torch")

ENV = "QUANTSERVE_TP"
STOP, STEP, EMBED, SCORE, STATS = range(5)  # rank 0's orders
# the longest a collective inside a forward waits for a rank that neither answers nor closes its connection
TIMEOUT = timedelta(seconds=float(os.environ.get("QUANTSERVE_TP_TIMEOUT", "60")))
IDLE = timedelta(days=365)  # the orders group's: ranks >= 1 wait there for the next order, however long
STATS_EVERY_S = 0.25  # how often rank 0 gathers the ranks' step times (/metrics shows the last gathered)


class RankLostError(ModelUnavailableError):
    """A tensor-parallel rank is gone: 503 (the server is up, the model is not)."""


@dataclass
class _Seq:
    """A sequence as another rank needs it for one step (what backends/torch/step.prepare_step reads)."""

    tokens: list[int]
    num_computed: int
    block_table: list[int]
    images: tuple = ()
    state_slot: int = (
        -1
    )  # Qwen3.5: the sequence's recurrent-state slot (each rank keeps its heads' part of it)


def encode_plan(plan: list[tuple[Any, int]], block_size: int) -> torch.Tensor:
    """[n, then per sequence: start, n, length, state slot, blocks, its n tokens, its blocks] as int64."""
    out = [len(plan)]
    for seq, n in plan:
        start = seq.num_computed
        blocks = seq.block_table[: -(-(start + n) // block_size)]
        slot = getattr(seq, "state_slot", -1)
        out += [start, n, len(seq.tokens), slot, len(blocks), *seq.tokens[start : start + n], *blocks]
    return torch.tensor(out, dtype=torch.int64)


def decode_plan(t: torch.Tensor) -> list[tuple[_Seq, int]]:
    v = t.tolist()
    plan, i = [], 1
    for _ in range(v[0]):
        start, n, length, slot, nb = v[i : i + 5]
        i += 5
        tokens = [0] * length
        tokens[start : start + n] = v[i : i + n]
        i += n
        plan.append((_Seq(tokens, start, v[i : i + nb], state_slot=slot), n))
        i += nb
    return plan


@dataclass
class Group:
    """The ranks as rank 0 sees them: the control group, and the other ranks' processes (None: not started here,
    as under torchrun)."""

    tp: TensorParallel
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def control(self) -> Any:
        return self.tp.orders

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


def _init(rank: int, world: int, addr: str, port: int, device: torch.device) -> TensorParallel:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if (
        backend == "nccl"
    ):  # a dead peer raises in the caller after TIMEOUT, instead of tearing the process down
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    return TensorParallel(rank, world, orders=dist.new_group(backend="gloo", timeout=IDLE))


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting its variables) started it; else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"])
    return None


def _torchrun_group(world: int, device: torch.device) -> Group:
    """Rank 0 under torchrun: the other ranks are started on their own machines by torchrun, not here."""
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError(
            f"--tensor-parallel-size {world}, but torchrun started {os.environ['WORLD_SIZE']} processes; give "
            "torchrun --nnodes x --nproc-per-node the same count",
            param="tensor_parallel_size",
        )
    tp = _init(0, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), device)
    log.info("tensor parallel: %d ranks (%s) started by torchrun, rank 0 here", world,
             "NCCL" if device.type == "cuda" else "gloo")  # fmt: skip
    return Group(tp, [])


def start_group(spec_path: Path, settings, device: torch.device) -> Group:
    """Start ranks 1..N-1 on this machine and join them as rank 0; they load their slices meanwhile. Under
    torchrun (several machines), join the ranks it started."""
    world = settings.torch.tensor_parallel_size
    if torchrun_rank() is not None:
        return _torchrun_group(world, device)
    port = _free_port()
    orders = {"spec": str(spec_path), "settings": dataclasses.asdict(settings), "world": world,
              "addr": "127.0.0.1", "port": port, "parent": os.getpid()}  # fmt: skip
    procs = []
    for rank in range(1, world):
        env = {**os.environ, ENV: json.dumps({**orders, "rank": rank})}
        if device.type == "cuda":
            env["LOCAL_RANK"] = str(rank)
        # a session of its own: a Ctrl-C in the terminal reaches rank 0, which stops the others
        cmd = [sys.executable, "-P", "-m", "quantserve.backends.torch.tp"]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    try:
        tp = _init(0, world, "127.0.0.1", port, device)
    except Exception:
        for p in procs:
            p.kill()
            p.wait()
        raise
    log.info("tensor parallel: %d ranks (%s), ranks 1-%d are pids %s", world,
             "NCCL" if device.type == "cuda" else "gloo", world - 1, ", ".join(str(p.pid) for p in procs))  # fmt: skip
    return Group(tp, procs)


class TPRunner(RunnerBase):
    """Rank 0's runner: the TorchRunner of its own slice, with every forward announced to the other ranks first.
    Forwards are serialised (the engine's steps and /v1/embeddings' own forwards would otherwise interleave their
    collectives)."""

    def __init__(self, inner, group: Group):
        self.inner, self.group = inner, group
        self._lock = threading.Lock()
        self._fault: str | None = None
        self._last = self._total = 0.0  # this rank's step seconds
        self._stats: list[tuple[float, float]] = []
        self._stats_at = 0.0

    def __getattr__(self, name: str):  # tokenizer, kv_spec, n_ctx, ...: the inner runner's
        return getattr(self.inner, name)

    @property
    def gpu_share(self) -> float:
        return self.inner.gpu_share

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
                    self._last = time.perf_counter() - t0
                    self._total += self._last
                    if time.monotonic() - self._stats_at > STATS_EVERY_S:
                        self._gather_stats()
            except Exception as exc:
                if getattr(self.inner, "sampling", False):
                    raise  # the sampler's own failure, after every collective: the ranks are in step
                # an order not delivered, or a forward that stopped part-way: a rank is gone, or the ranks are out
                # of step; either way no later step can be trusted
                time.sleep(0.5)  # let a dead rank's exit be seen, to name it
                self._fault = self.group.gone() or f"a tensor-parallel step failed part-way ({exc})"
                log.error("tensor parallel: %s", self._fault)
                raise RankLostError(f"the model is unavailable: {self._fault}; restart the server") from exc
            return out

    def _gather_stats(self) -> None:
        """Every rank's step times, gathered between steps on the engine's thread (with the collectives' own
        timeout) and kept for /metrics, which never waits on the ranks."""
        import torch.distributed as dist

        self._stats_at = time.monotonic()
        self.group.send(STATS)
        device = self.inner.device
        times = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(self.group.tp.world)]
        dist.all_gather(times, torch.tensor([self._last, self._total], dtype=torch.float64, device=device))
        self._stats = [(float(t[0]), float(t[1])) for t in times]

    def rank_step_seconds(self) -> list[tuple[float, float]]:
        """(last step, all steps) in seconds, per rank, as last gathered (every STATS_EVERY_S while steps run)."""
        return list(self._stats)

    def _check_tokens(self, tokens: list[int]) -> None:
        if any(not 0 <= t < self.inner.n_vocab for t in tokens):
            raise InvalidRequestError(f"token ids must be in [0, {self.inner.n_vocab})", param="input")

    def execute(self, plan):
        payload = encode_plan(plan, self.inner.block_size)
        return self._run(STEP, payload, 0, lambda: self.inner.execute(plan))

    def embed(self, tokens: list[int]) -> list[float]:
        self._check_tokens(tokens)
        return self._run(EMBED, torch.tensor(tokens), 0, lambda: self.inner.embed(tokens))

    def score(self, tokens: list[int], first: int):
        self._check_tokens(tokens)
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


def serve_rank(runner, orders: Any) -> None:
    """Ranks >= 1: run rank 0's orders until it says stop (or is gone, which fails the next broadcast)."""
    import torch.distributed as dist

    last = total = 0.0
    while True:
        head = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(head, src=0, group=orders)
        cmd, size, extra = head.tolist()
        payload = torch.zeros(size, dtype=torch.int64)
        if size:
            dist.broadcast(payload, src=0, group=orders)
        if cmd == STOP:
            return
        t0 = time.perf_counter()
        if cmd == STEP:
            runner.execute(decode_plan(payload))
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            last = time.perf_counter() - t0
            total += last
        elif cmd == EMBED:
            runner.embed(payload.tolist())
        elif cmd == SCORE:
            runner.score(payload.tolist(), extra)
        elif cmd == STATS:  # on the compute group, with its timeout
            device = runner.device
            times = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
            dist.all_gather(times, torch.tensor([last, total], dtype=torch.float64, device=device))


def rank_main() -> int:
    """A rank >= 1 started by rank 0 (start_group): its orders are in $QUANTSERVE_TP."""
    from quantserve.core.settings import EngineSettings, LlamaCppSettings, TorchSettings
    from quantserve.formats import detect

    orders = json.loads(os.environ[ENV])
    exit_with_parent(orders["parent"])  # not the kernel's signal: rank 0 starts ranks from a loading thread
    raw = orders["settings"]
    settings = EngineSettings(
        **{k: v for k, v in raw.items() if k not in ("llamacpp", "torch")},
        llamacpp=LlamaCppSettings(**raw["llamacpp"]),
        torch=TorchSettings(**raw["torch"]),
    )
    spec = detect(Path(orders["spec"]))
    return run_rank(spec, settings, orders["rank"], orders["world"], orders["addr"], orders["port"])


def run_rank(spec, settings, rank: int, world: int, addr: str, port: int) -> int:
    """Serve rank 0's orders as rank `rank` >= 1 until it stops (or is gone); exits the process.

    Under torchrun, `quantserve run` on every machine but rank 0's comes here (quantserve.cli.serve)."""
    import torch.distributed as dist

    from quantserve.backends.torch.backend import load_slice

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)-7s %(message)s")
    if world != settings.torch.tensor_parallel_size:
        log.error("torchrun started %d processes; --tensor-parallel-size is %d", world,
                  settings.torch.tensor_parallel_size)  # fmt: skip
        os._exit(2)
    device, _ = _device(spec, int(os.environ.get("LOCAL_RANK", rank)))
    code = 0
    try:
        tp = _init(rank, world, addr, port, device)
        runner = load_slice(spec, settings, tp, device)
        dist.barrier(group=tp.orders)  # loaded: rank 0 waits for this
        serve_rank(runner, tp.orders)
    except Exception as exc:  # noqa: BLE001 - rank 0 gone (the orders fail), or this rank's own failure
        log.error("rank %d stops: %s", rank, exc, exc_info=not isinstance(exc, RuntimeError))
        code = 1
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    os._exit(code)  # not through interpreter shutdown, where a process group's threads could abort


def _device(spec, rank: int) -> tuple[torch.device, torch.dtype]:
    from quantserve.backends.torch.backend import pick_device_dtype

    device, dtype = pick_device_dtype(spec.config or {})
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device, dtype


if __name__ == "__main__":
    sys.exit(rank_main())
