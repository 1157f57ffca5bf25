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

# Every test, the slow end-to-end ones included (what CI runs).
test: $(STAMP)
	$(BIN)/python -m pytest -q

# The quick loop while editing: every test not marked slow.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/preprocess.py

clean:
	rm -rf $(VENV) runs
