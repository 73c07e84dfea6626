#!/usr/bin/env bash
# The wheels a GPU machine lacks, downloaded into .whl/ (ignored by git) for a device call to carry: see
# bench/gpu/wheels.py for how the set is computed. Needs `make setup` first (it reads the venv's versions).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" bench/gpu/wheels.py "$@"
