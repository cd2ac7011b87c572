# The README's two commands: `make demo` (train + PTQ sweep on the embedded corpus) and
# `make test` (the whole suite). Both create .venv and install what they need.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: demo test test-reference bench install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .
	-$(BIN)/python -m qjax.kernels.build

install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	-$(BIN)/python -m qjax.kernels.build

demo: install
	XLA_FLAGS= $(BIN)/python -m experiments.demo --config=configs/demo.py

# --dist loadscope: one worker runs a whole module, so the Gemma model loads once.
test: install-test
	$(BIN)/python -m pytest tests -q -n 2 --dist loadscope --durations=15

# Regenerate the goldens live from HF transformers (CPU torch), then compare qjax with them.
test-reference: install-test
	$(BIN)/pip install -q -e '.[reference]'
	XLA_FLAGS= $(BIN)/python scripts/make_reference.py
	$(BIN)/python -m pytest tests/checkpoints -q -n 2 --dist loadscope

bench: install
	XLA_FLAGS= $(BIN)/python -m benchmarks.qdot_bench

clean:
	rm -rf results/ .pytest_cache
