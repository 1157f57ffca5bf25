# Two commands are all a newcomer needs: `make run` and `make test`.
# `make gpu-check`: on a machine with a CUDA GPU, the GPU tests and benchmark rows in one report (docs/gpu.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint bench gpu-check clean

# Creates .venv when missing. torch is installed first and pinned, so that pip takes the
# CPU wheel that lies on disk instead of downloading a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/dlrmflow demo

# The tests run in TEST_WORKERS processes (pytest-xdist): some of them wait on subprocesses, servers and
# sockets rather than on a core, hence more workers than CI's 2 cores, but not many more: measured on 2 cores,
# the whole suite took 669 s with 3 workers and 688 s with 4 (16.4 and 17.3 CPU minutes: their contention
# costs more CPU than the waits they fill; earlier, 781 s with 6). --dist loadfile keeps a test module in one worker, in order, so a module-scoped fixture (a
# LocalCluster, an external Dask cluster, a Prefect server) starts once, as in a serial run. (Not --dist
# loadgroup: pytest-xdist 3.8 ignores xdist_group marks under pytest 9.2, pytest-xdist issue #1386.)
# --no-loadscope-reorder: modules go out in collection order, where tests/conftest.py puts the longest first
# (xdist's own order, most tests first, sends them last).
# `make test TEST_WORKERS=0` runs the tests serially, in this process.
# env -u PYTHONDONTWRITEBYTECODE: where the environment sets it (this machine's does), every one of the suite's 160-odd
# Python processes compiled the project's modules anew (0.33 CPU s for all of them) and each worker rewrote the
# test modules; with it unset, they are compiled once, into __pycache__.
TEST_WORKERS ?= 3
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Every test, the slow end-to-end ones included (what CI runs).
test: $(STAMP)
	$(PYTEST)

# The quick loop while editing: every test not marked slow.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/preprocess.py

# On a machine with a CUDA GPU: every CUDA test and the GPU rows of the benchmarks in at most 8 minutes, written
# to one report (benchmarks/gpu_check.md; docs/gpu.md). Without a GPU it says so in one line and exits 0, and
# installs nothing. CuPy (the extra cuda12 or cuda13) is installed only when torch sees a CUDA device and no CuPy
# is installed: the extra follows torch's CUDA major version, since CuPy's wheels are built per CUDA major and
# torch's build is known to run on this driver; an installed CuPy is left alone (two cupy-cuda* wheels clash).
# GPU_PYTHON=python3: that interpreter instead of the venv, and no venv is made (a machine without a package
# index, whose Python has torch, CuPy and the project: docs/gpu.md). GPU_CHECK_ARGS: the script's options.
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=
gpu-check: $(if $(GPU_PYTHON),,$(STAMP))
	@py='$(or $(GPU_PYTHON),$(BIN)/python)'; extra=$$($$py benchmarks/gpu_check.py --cuda-extra) || exit 1; \
	if [ -n "$$extra" ]; then echo "gpu-check: installing CuPy: pip install -e '.[$$extra]'"; \
		$$py -m pip install --quiet -e ".[$$extra]" || echo "gpu-check: the install failed; the CuPy step says so"; \
	fi; \
	$$py benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs
