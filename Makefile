# gemma-engine: `make run` and `make test` set up a fresh machine by themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a CUDA machine: make setup TORCH=torch (or a pinned CUDA build).
TORCH ?= torch==2.13.0
PROMPT ?= The capital of France is
ARGS ?=
STAMP := $(VENV)/.installed
# The default model's first decode graphs, built once into the compile cache (gemma_engine/compile_cache.py).
PRECOMPILED := $(VENV)/.precompiled

.PHONY: setup weights precompile run test lint format bench bench-buckets llama-cpp llama-tools llama-batched-bench llama-server clean

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

# Build the default model's first decode graphs now, once (a minute or two), so that a first run
# decodes at full speed from its first tokens instead of pausing to compile.
$(PRECOMPILED): $(STAMP) $(wildcard gemma_engine/*.py) | weights
	$(BIN)/gemma-run --precompile
	touch $@

precompile: weights
	$(BIN)/gemma-run --precompile $(ARGS)

run: weights $(PRECOMPILED)
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

# llama.cpp, the speed anchor, built from the llama-cpp-python sdist (about 10 minutes per build on
# 2 cores): once for this CPU and once for AVX2 only, so an AVX-512 machine can stand in for Zen 3.
# --no-cache-dir: pip would otherwise reuse the first build's wheel for the second.
# Use with: scripts/bench.py --llama-cpp-path .llama/native (or --capability avx2 --llama-cpp-path .llama/avx2).
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_AVX2 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
# On a CPU with AMX, ggml's AMX matrix kernels crashed llama-server at its first product on this
# project's VMs (SIGSEGV in ggml_backend_amx_mul_mat, 2026-12-05): there the build names every
# other instruction set of the CPU instead of -march=native, and leaves AMX out.
LLAMA_AVX512 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CMAKE ?= $(if $(shell grep -m1 -o amx_tile /proc/cpuinfo 2>/dev/null),$(LLAMA_AVX512),-DGGML_NATIVE=ON)
llama-cpp: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/pip install -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
		--target .llama/native "$(LLAMA_CPP)"
	CMAKE_ARGS="$(LLAMA_AVX2)" $(BIN)/pip install -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
		--target .llama/avx2 "$(LLAMA_CPP)"

# llama.cpp's tools from the vendored source of the same sdist, in one build (10-20 minutes on 2
# cores): .llama/bin/llama-batched-bench (parallel decoding, for scripts/bench_batch.py) and
# .llama/bin/llama-server (its OpenAI-compatible server, for scripts/bench_serve.py).
# LLAMA_CMAKE="$(LLAMA_AVX2)" builds them for AVX2 only.
LLAMA_TOOLS := llama-batched-bench llama-server
llama-tools: $(STAMP)
	rm -rf .llama/src && mkdir -p .llama/src .llama/bin
	$(BIN)/pip download -q --no-deps --no-binary :all: -d .llama/src "$(LLAMA_CPP)"
	tar xzf .llama/src/llama_cpp_python-*.tar.gz -C .llama/src
	cmake -S .llama/src/llama_cpp_python-*/vendor/llama.cpp -B .llama/src/build -G Ninja \
		-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_CMAKE)
	cmake --build .llama/src/build --target $(LLAMA_TOOLS) -j 2
	for t in $(LLAMA_TOOLS); do \
		cp .llama/src/build/bin/$$t .llama/bin/$$t.partial && mv .llama/bin/$$t.partial .llama/bin/$$t; \
	done
	rm -rf .llama/src
llama-batched-bench llama-server: llama-tools

clean:
	rm -rf $(VENV) weights/gemma-3-270m
