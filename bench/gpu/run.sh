#!/usr/bin/env bash
# The CUDA half on a GPU in one run: see bench/gpu/run.py for the steps and bench/gpu/README.md for the device calls.
#
#   bench/gpu/run.sh --out DIR               # a CUDA machine: installs .whl/ (bench/gpu/wheels.sh) first
#   bench/gpu/run.sh --cpu-smoke --out DIR   # here: the same script on tiny shapes, CPU and Triton's interpreter
#
# quantserve runs from this tree, laid out as pip installs it (kernels/ and converters/ become quantserve.kernels and
# quantserve.converters) in a temporary folder; PYTHONSAFEPATH keeps the tree's own quantserve/ off sys.path, so that
# no child process imports the half package. PYTHON picks the interpreter (default .venv/bin/python, else python3).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=$root/.venv/bin/python; else py=python3; fi
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/quantserve-gpu.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
site=$tmp/site
mkdir -p "$site" "$tmp/src"
pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if compgen -G ".whl/*.whl" >/dev/null && [ "$pyver" != 3.12 ]; then
  echo "not installing .whl/: its wheels are for the GPU machine's Python 3.12, this is $pyver"
elif compgen -G ".whl/*.whl" >/dev/null; then
  echo "installing $(ls .whl/*.whl | wc -l) carried wheels into $site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "error: the carried wheels did not install (run bench/gpu/wheels.sh again)" >&2; exit 2; }
fi
cp -r quantserve "$tmp/src/quantserve"
cp -r kernels "$tmp/src/quantserve/kernels"
cp -r converters "$tmp/src/quantserve/converters"
export PYTHONPATH="$tmp/src:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
"$py" "$root/bench/gpu/run.py" "$@"
