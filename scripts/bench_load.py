"""Loading a quantized model with and without the quantized-weight cache (quantized_cache.py).

.venv/bin/python scripts/bench_load.py [--model PATH] [--quantize int8] [--processes 2] [--loads 3]

Each process times ``Engine.from_pretrained(model, quantize=..., compile=False)`` ``--loads``
times in a row; processes alternate between the cache switched off (its read and write
replaced by no-ops: every load quantizes) and on (the entry written by an earlier load is
read). The first load of a process also pays for reading the checkpoint's pages and torch's
first calls; the table reports the later ones, median (min-max) over all processes of a mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

CHILD = """
import json, sys, time
import torch
from gemma_engine import Engine, quantized_cache
model, quantize, loads, mode = sys.argv[1] or None, sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(2)
if mode == "off":
    quantized_cache.Entry.read = lambda self: None
    quantized_cache.Entry.write = lambda self, tensors: None
times = []
for _ in range(loads):
    start = time.perf_counter()
    engine = Engine.from_pretrained(model, quantize=quantize, compile=False, max_batch=1)
    times.append(time.perf_counter() - start)
    del engine
print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="default: the default model")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--processes", type=int, default=2, help="per mode")
    parser.add_argument("--loads", type=int, default=3, help="per process")
    args = parser.parse_args()
    info = bu.machine_info("cpu", 2)
    print(bu.machine_line(info))
    later: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.processes):
        for mode in ("off", "on"):
            argv = [args.model, args.quantize, str(args.loads), mode]
            run = subprocess.run(
                [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True
            )
            times = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"cache {mode}: " + ", ".join(f"{t:.2f} s" for t in times), flush=True)
            later[mode] += times[1:]
    rows = []
    for mode, label in (("off", "quantized at load"), ("on", "read from the cache")):
        t = later[mode]
        rows.append([label, f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"])
    print(bu.md_table([f"{args.quantize} load, later loads of a process", "seconds"], rows))
    print(f"git {info.get('git', '?')}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
