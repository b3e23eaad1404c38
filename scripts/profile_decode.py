"""Profile one compiled decode step of the default model: where a token's time goes.

.venv/bin/python scripts/profile_decode.py [--context 512] [--steps 10] [--quantize int8]
    [--batch 8] [--capability avx2] [--kernels] [--no-compile]

``--batch B`` profiles one batched step of B rows (issue #11's profile); ``--kernels`` times
each inductor kernel, named after the ops it fuses (the output layer's is the one that reads
the 262,144-row matrix). A saved graph's name does not cover inductor's settings, so graphs
built to time their kernels live in a compile cache of their own (``kernel-profile`` beside
the engine's folders), never mixed with the ones ``gemma-run`` loads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

from gemma_engine import Engine, compile_cache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=512, help="position of the decode step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=8, help="rows of the profile table")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded in the step")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--quantize", default=None, help="none, int8 or int4")
    parser.add_argument("--capability", choices=["native", "avx2"], default="native")
    parser.add_argument(
        "--kernels", action="store_true", help="time each inductor kernel (slows the step)"
    )
    args = parser.parse_args()
    bu.reexec_lowered(args.capability)
    torch.set_num_threads(2)
    if args.kernels:
        os.environ["GEMMA_ENGINE_CACHE"] = str(compile_cache.root() / "kernel-profile")
        torch._inductor.config.cpp.enable_kernel_profile = True
    engine = Engine.from_pretrained(
        args.model,
        compile=not args.no_compile,
        max_seq_len=max(1024, args.context),
        max_batch=args.batch,
        quantize=args.quantize,
    )
    tokens = torch.full((args.batch, 1), 100)
    pos = torch.full((args.batch,), args.context - 1)
    kv_len = engine.bucket_for(args.context)
    for _ in range(3):  # compile and warm up
        engine.step(tokens, pos, kv_len)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step(tokens, pos, kv_len)
        times.append(time.perf_counter() - start)
    print(
        f"decode step of {args.batch} row(s) at context {args.context} (bucket {kv_len}): median "
        f"{statistics.median(times) * 1e3:.1f} ms over {args.steps} steps"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step(tokens, pos, kv_len)
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60
        )
    )


if __name__ == "__main__":
    main()
