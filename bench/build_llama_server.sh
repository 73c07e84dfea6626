#!/usr/bin/env bash
# Build the native llama-server and llama-bench from the llama.cpp vendored in llama-cpp-python's sdist.
#
# Same llama.cpp commit as the llama-cpp-python wheel in .venv, so bench/serving.py compares servers, not
# llama.cpp versions. Output: bench/.build/llama-server and bench/.build/llama-bench.
#
# Usage: bench/build_llama_server.sh            (JOBS=2 and LLAMA_CPP_PYTHON_VERSION=0.3.36 by default)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/bench/.build"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"

# These CPUs advertise AMX but fault on its instructions (SIGILL at tilezero on any batch > 1 token);
# the same flags as the Makefile's LLAMA_CMAKE_ARGS.
NO_AMX='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'

mkdir -p "$BUILD/sdist"
SDIST="$BUILD/sdist/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$BUILD/sdist"
fi
[[ -f "$SDIST" ]] || SDIST="$(ls "$BUILD"/sdist/llama_cpp_python-"$VERSION".tar.gz "$BUILD"/sdist/llama-cpp-python-"$VERSION".tar.gz 2>/dev/null | head -1)"
[[ -f "$SDIST" ]] || { echo "error: no sdist for llama-cpp-python $VERSION under $BUILD/sdist" >&2; exit 1; }

SRC="$BUILD/src"
# `make test` extracts only llama.cpp's test material into the same folder, so look for the sources themselves.
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" --strip-components=1
fi

# BUILD_SHARED_LIBS=OFF: the copied binaries then need no libllama.so/libggml.so beside them.
# LLAMA_*UI=OFF: the web UI is not needed for benchmarks and its prebuilt download needs the network.
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD/cmake" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$NO_AMX" \
    -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$BUILD/cmake" --config Release -j "$JOBS" --target llama-server llama-bench

for bin in llama-server llama-bench; do
    cp "$BUILD/cmake/bin/$bin" "$BUILD/$bin"
done
"$BUILD/llama-server" --version 2>&1 | head -3 || true
echo "built: $BUILD/llama-server $BUILD/llama-bench"
