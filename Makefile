# Two commands are all a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint bench clean

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
# the whole suite took 634 s with 3 workers, 705 s with 4 and 781 s with 6 (their contention costs more CPU
# than the waits they fill: 16.1, 18.7 and more CPU minutes). --dist loadfile keeps a test module in one worker, in order, so a module-scoped fixture (a
# LocalCluster, an external Dask cluster, a Prefect server) starts once, as in a serial run. (Not --dist
# loadgroup: pytest-xdist 3.8 ignores xdist_group marks under pytest 9.2, pytest-xdist issue #1386.)
# --no-loadscope-reorder: modules go out in collection order, where tests/conftest.py puts the longest first
# (xdist's own order, most tests first, sends them last).
# `make test TEST_WORKERS=0` runs the tests serially, in this process.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

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

clean:
	rm -rf $(VENV) runs
