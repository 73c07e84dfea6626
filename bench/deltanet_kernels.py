"""Qwen3.5's Gated DeltaNet on a GPU: the Triton kernels (kernels/deltanet.py) against the PyTorch forms they replace
on CUDA, measured in the same run, at transformers' default Qwen3.5 sizes (16 key heads, 32 value heads of 128).

- decode: one step for a batch of sequences, each state in its slot. PyTorch's path is the runner's own without
  the kernel: gather the slots' states, the recurrent rule, scatter them back.
- prefill: one sequence's prompt from its slot's state. PyTorch's path is the chunked rule (64 tokens a chunk).

Each row has both times, their ratio (PyTorch / kernel: above 1, the kernel is faster) and the kernel's largest
error relative to PyTorch's output.

    python bench/deltanet_kernels.py --out deltanet.json     # on a CUDA GPU
    python bench/deltanet_kernels.py --cpu-smoke             # tiny sizes, the CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _inputs(b: int, t: int, n_k: int, n_v: int, d: int, device, gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = torch.nn.functional.normalize(randn(b, t, n_k, d), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(randn(b, t, n_k, d), dim=-1)
    v = randn(b, t, n_v, d)
    g = -torch.rand(b, t, n_v, generator=gen).to(device)
    beta = torch.rand(b, t, n_v, generator=gen).to(device)
    return q, k, v, g, beta


def _time(fn, iters: int, device) -> float:
    fn()  # warm-up (and the kernels' compile)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def _decode(device, b: int, n_k: int, n_v: int, d: int, iters: int, gen) -> dict:
    from quantserve.backends.torch.deltanet import delta_rule_recurrent
    from quantserve.kernels import deltanet

    q, k, v, g, beta = _inputs(b, 1, n_k, n_v, d, device, gen)
    state = 0.1 * torch.randn(b + 2, n_v, d, d, generator=gen).to(device)
    slots = torch.randperm(b + 2, generator=gen)[:b].to(device)
    work = state.clone()
    rep = n_v // n_k

    def torch_step():
        o, new = delta_rule_recurrent(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
                                      work[slots])  # fmt: skip
        work[slots] = new
        return o[:, 0]

    def kernel_step():
        return deltanet.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], work, slots)

    want = torch_step()
    work.copy_(state)
    got = kernel_step()
    err = float((got - want).abs().max() / want.abs().max())
    ms_torch, ms_kernel = _time(torch_step, iters, device), _time(kernel_step, iters, device)
    return {"what": "decode", "batch": b, "torch_ms": ms_torch, "kernel_ms": ms_kernel, "ratio": ms_torch / ms_kernel,
            "rel_err": err}  # fmt: skip


def _prefill(device, t: int, n_k: int, n_v: int, d: int, iters: int, gen) -> dict:
    from quantserve.backends.torch.deltanet import delta_rule_chunked
    from quantserve.kernels import deltanet

    q, k, v, g, beta = _inputs(1, t, n_k, n_v, d, device, gen)
    state = 0.1 * torch.randn(2, n_v, d, d, generator=gen).to(device)
    work = state.clone()
    rep = n_v // n_k

    def torch_prefill():
        qr, kr = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        return delta_rule_chunked(qr, kr, v, g, beta, state[1:2])[0][0]

    def kernel_prefill():
        work.copy_(state)
        return deltanet.prefill(q[0], k[0], v[0], g[0], beta[0], work, 1)

    want, got = torch_prefill(), kernel_prefill()
    err = float((got - want).abs().max() / want.abs().max())
    ms_torch, ms_kernel = _time(torch_prefill, iters, device), _time(kernel_prefill, iters, device)
    return {"what": "prefill", "tokens": t, "torch_ms": ms_torch, "kernel_ms": ms_kernel,
            "ratio": ms_torch / ms_kernel, "rel_err": err}  # fmt: skip


def run(device, n_k: int, n_v: int, d: int, batches: list[int], prompts: list[int], iters: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = [_decode(device, b, n_k, n_v, d, iters, gen) for b in batches]
    return rows + [_prefill(device, t, n_k, n_v, d, iters, gen) for t in prompts]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on the CPU under Triton's interpreter"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on the CPU under Triton's interpreter"
    )
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device, sizes, batches, prompts, iters = torch.device("cpu"), (2, 4, 16), [1, 2], [20], 1
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA GPU (or --cpu-smoke)")
        device, sizes, batches, prompts, iters = (
            torch.device("cuda"),
            (16, 32, 128),
            [1, 16, 64],
            [512, 4096],
            20,
        )
    rows = run(device, *sizes, batches, prompts, iters)
    for r in rows:
        size = f"batch {r['batch']}" if r["what"] == "decode" else f"{r['tokens']} tokens"
        print(f"{r['what']:8} {size:12} torch {r['torch_ms']:8.3f} ms  kernel {r['kernel_ms']:8.3f} ms  "
              f"x{r['ratio']:.2f}  rel err {r['rel_err']:.1e}")  # fmt: skip
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
              "sizes": dict(zip(("key_heads", "value_heads", "head_dim"), sizes, strict=True)), "rows": rows}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["rel_err"] < 1e-4 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
