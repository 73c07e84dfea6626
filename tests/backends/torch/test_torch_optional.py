"""PyTorch is an extra (`quantserve[torch]`): without it the llama.cpp path serves, inspects and converts GGUF, and
whatever needs torch stops with an error naming the extra. Each case runs in a child process whose `torch` is
made unimportable, as on a llama.cpp-only install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.fixtures.formats import dense_tensors, write_hf

NO_TORCH = "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"


def without_torch(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def cli_without_torch(*args: str) -> subprocess.CompletedProcess:
    return without_torch(
        f"sys.argv = ['quantserve', *{list(args)!r}]\nfrom quantserve.cli import main\nmain()"
    )


@pytest.mark.slow
def test_the_llamacpp_path_needs_no_torch(smollm2_gguf):
    out = without_torch(
        "import asyncio, quantserve\n"
        "llm = quantserve.load('smollm2', ctx_size=512, max_num_seqs=1)\n"
        "async def go():\n"
        "    return ''.join([t async for t in llm.chat([{'role': 'user', 'content': 'Say hi.'}], max_tokens=4)])\n"
        "print(llm.info.backend, repr(asyncio.run(go())))\n"
        "llm.close()\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    backend, _, rest = out.stdout.strip().splitlines()[0].partition(" ")
    assert backend == "llamacpp" and len(rest) > 2
    assert out.stdout.strip().splitlines()[-1] == "False"
    inspect = cli_without_torch("inspect", str(smollm2_gguf))
    assert inspect.returncode == 0 and "load it with llama.cpp:" in inspect.stdout, inspect.stderr[-2000:]


@pytest.mark.parametrize(
    "args,what",
    [
        (["run", "{gguf}", "--backend", "torch"], "the torch backend needs PyTorch"),
        (["convert", "--src", "{hf}", "--dst", "{tmp}/out", "--quant", "gptq"], "--quant gptq needs PyTorch"),
        (["convert", "--src", "{hf}", "--dst", "{tmp}/out", "--format", "marlin"], "--format needs PyTorch"),
        (
            ["eval", "ppl", "{gguf}", "--text", "{text}", "--backend", "torch"],
            "scoring with --backend torch needs",
        ),
    ],
)
def test_what_needs_torch_names_the_extra(args, what, smollm2_gguf, tmp_path):
    hf = write_hf(tmp_path / "hf", dense_tensors())
    (tmp_path / "text.txt").write_text("Some text to score. " * 200)
    args = [a.format(gguf=smollm2_gguf, hf=hf, tmp=tmp_path, text=tmp_path / "text.txt") for a in args]
    out = cli_without_torch(*args)
    assert out.returncode == 2, (out.stdout[-1000:], out.stderr[-2000:])
    assert what in out.stderr and "pip install 'quantserve[torch]'" in out.stderr
    assert "Traceback" not in out.stderr
