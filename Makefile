# The README's two commands: `make demo` (train + PTQ sweep on the embedded corpus) and
# `make test` (the whole suite). Both create .venv and install what they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# tests/conftest.py adds its fast-compile XLA flags to these, whether or not XLA_FLAGS was set.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: demo test test-gpu test-py312 test-reference bench device-check install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The CPU kernel builds itself on first use into ~/.cache/qjax/kernels (docs/cpu_kernel.md);
# `python -m qjax.kernels.build` does it now, so the first model call does not wait for g++.
install: $(BIN)/python
	$(BIN)/pip install -q -e .
	-$(BIN)/python -m qjax.kernels.build

# The compile-only TPU/GPU toolchains (libtpu, the CUDA plugin), pinned to the installed jax,
# in a folder of their own (~/.cache/qjax/aot; qjax.aot.toolchain): tests/aot compiles for a
# TPU and a GPU with them.
install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	-$(BIN)/python -m qjax.kernels.build
	$(BIN)/python -m qjax.aot.install

# Quiet by default (INFO logging off); `make demo DEMO_FLAGS=--verbosity=0` brings it back.
DEMO_FLAGS ?=
demo: install
	XLA_FLAGS= $(BIN)/python -m experiments.demo --config=configs/demo.py $(DEMO_FLAGS)

# --dist loadscope: one worker runs a whole module, so the Gemma model loads once.
# --max-worker-restart=0: a worker that dies (a native crash) fails the run at once; with a
# restart, pytest-xdist 3.8 loadscope can wait forever for the dead worker (pytest-xdist#1323).
test: install-test
	$(BIN)/python -m pytest tests -q -n 2 --dist loadscope --max-worker-restart=0 --durations=15

# The suite on one NVIDIA GPU (JAX_PLATFORMS=tpu on a Cloud TPU VM): the accelerator is the
# default backend, f32 matmuls run at 'highest' precision, the mesh tests run on the host's
# simulated CPU devices and no worker preallocates the device's memory (tests/conftest.py).
GPU_WORKERS ?= 8
test-gpu: $(BIN)/python
	$(BIN)/pip install -q -e '.[test,cuda]'
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cuda} $(BIN)/python -m pytest tests -q -n $(GPU_WORKERS) \
	  --dist loadscope --max-worker-restart=0 --durations=15

# What qjax costs on this machine's accelerator: results/device_check/device_check.{json,md,png}.
device-check: install
	$(BIN)/python -m benchmarks.device_check

# The second supported Python (what accelerator machines run: 3.12, jax 0.11/0.12), in its own
# venv, with the CPU kernel switched off (QJAX_CPU_KERNEL=0), so that this run exercises the
# pure-XLA fallback paths (kernels.status() says so) while `make test` runs the kernel.
# The first python3.12 that runs: on PATH, else a pyenv install (pyenv's shim refuses to run a
# version that is not selected, so the shim alone is not enough).
PY312 ?= $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null); do \
  $$p -c 'import sys' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV312 ?= .venv312
$(VENV312)/bin/python:
	@test -n "$(PY312)" || { echo "test-py312: no runnable python3.12 found (PATH or ~/.pyenv/versions/3.12*); install one or pass PY312=/path/to/python3.12"; exit 1; }
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip

# Several pytest processes, not one: under jaxlib 0.12.0.1 one process running the whole
# suite segfaults inside jaxlib after ~550-630 tests (history-dependent, not one test's
# fault; docs/py312_crash.md). tests/run_parts.sh runs every test, one process per tests/
# subdirectory, the PTQ methods module (where it crashed twice) in its own.
test-py312: $(VENV312)/bin/python
	$(VENV312)/bin/pip install -q -e '.[test]'
	$(VENV312)/bin/python -m qjax.aot.install
	$(VENV312)/bin/python -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__)'
	QJAX_CPU_KERNEL=0 tests/run_parts.sh $(VENV312)/bin/python -q -n 2 --dist loadscope --max-worker-restart=0 --durations=15

# Regenerate the goldens live from HF transformers (CPU torch), then compare qjax with them.
test-reference: install-test
	$(BIN)/pip install -q -e '.[reference]'
	XLA_FLAGS= $(BIN)/python scripts/make_reference.py
	$(BIN)/python -m pytest tests/checkpoints -q -n 2 --dist loadscope

# Lint (ruff, configured in pyproject.toml) the whole tree, which is clean, so that no file
# drifts (a clone of main has no changed files to lint). `make lint LINT_FILES=` lints only the
# Python files and notebooks changed against LINT_BASE (main, else origin/main).
RUFF_VERSION := 0.17.6
LINT_BASE ?= main
LINT_FILES ?= .
.PHONY: lint
lint: $(BIN)/python
	@$(BIN)/ruff --version 2>/dev/null | grep -qx 'ruff $(RUFF_VERSION)' || $(BIN)/pip install -q 'ruff==$(RUFF_VERSION)'
	@files='$(LINT_FILES)'; \
	if [ -z "$$files" ]; then \
	  base=$$(git rev-parse -q --verify '$(LINT_BASE)' || git rev-parse -q --verify 'origin/$(LINT_BASE)') \
	    || { echo "lint: no ref '$(LINT_BASE)' or 'origin/$(LINT_BASE)'; pass LINT_BASE=<ref> or LINT_FILES=."; exit 2; }; \
	  files=$$( { git diff --name-only --diff-filter=d $$(git merge-base $$base HEAD) -- '*.py' '*.ipynb'; \
	              git ls-files --others --exclude-standard -- '*.py' '*.ipynb'; } | sort -u); \
	fi; \
	if [ -z "$$files" ]; then echo "lint: no Python files changed against $(LINT_BASE)"; exit 0; fi; \
	echo "ruff check on $$(echo $$files | wc -w) path(s)"; \
	$(BIN)/ruff check $$files

bench: install
	XLA_FLAGS= $(BIN)/python -m benchmarks.qdot_bench

clean:
	rm -rf results/ .pytest_cache
