"""Decode attention for one new token on this machine: bmm against the compiled step's fused
reductions (layers.one_query_attention), over Gemma 3 270M's shapes (4 query heads sharing one
key head of 256; 18 layers, each with its own random cache).

    .venv/bin/python scripts/bench_attention.py [--keys 256,544,1024,4096] [--capability avx2]

Each form runs the 18 layers' attention in one graph, built and called the way the engine calls
a decode step (saved_graphs: an AOTInductor package, C++ from end to end), each layer's query
depending on the layer before. Rounds alternate between the forms; prints the median
microseconds per layer and the keys and values read per second. Keys are stored positions: 544
is a sliding layer's ring at 1k positions and more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

from gemma_engine import layers, saved_graphs  # noqa: E402

GROUP, HEAD_DIM, LAYERS, SCALING = 4, 256, 18, 256**-0.5


def bmm_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
    """The engine's library path (model.Attention elsewhere than a CPU decode step)."""
    return layers.library_attention(q, keys, values, visible, SCALING, None)


def fused_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
    return layers.one_query_attention(q, keys, values, visible, SCALING, None)


class Caches(nn.Module):
    def __init__(self, keys: int) -> None:
        super().__init__()
        for i in range(LAYERS):
            self.register_buffer(f"k{i}", torch.randn(1, 1, keys, HEAD_DIM))
            self.register_buffer(f"v{i}", torch.randn(1, 1, keys, HEAD_DIM))


def layers_of(attention):
    def run(model: Caches, q: Tensor, visible: Tensor) -> Tensor:
        for i in range(LAYERS):
            q = q + 1e-3 * attention(q, getattr(model, f"k{i}"), getattr(model, f"v{i}"), visible)
        return q

    run.__name__ = run.__qualname__ = f"layers_of_{attention.__name__}"
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="256,544,1024,4096")
    parser.add_argument("--capability", choices=["native", "avx2"], default="native")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    bu.reexec_lowered(args.capability)
    torch.set_num_threads(2)
    info = bu.machine_info("cpu", 2)
    print(f"Machine: {bu.machine_line(info)}; {info['date_utc']}")
    print(f"Versions: torch {torch.__version__}, gemma-engine git {info['git']}\n")
    print("| keys | bmm us/layer | fused us/layer | bmm GB/s | fused GB/s | bmm / fused |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    forms = {"bmm": bmm_attention, "fused": fused_attention}
    with tempfile.TemporaryDirectory() as folder:
        for keys in [int(k) for k in args.keys.split(",")]:
            q = torch.randn(1, 1, GROUP, HEAD_DIM) * 0.1
            visible = torch.ones(1, 1, 1, keys, dtype=torch.bool)
            visible[..., keys - 7 :] = False
            graphs = {}
            for name, attention in forms.items():
                torch.manual_seed(0)  # the same caches for both forms
                graph, _ = saved_graphs.get(
                    Path(folder), Caches(keys), layers_of(attention), (q, visible)
                )
                graphs[name] = graph
            times = {name: [] for name in graphs}
            for _ in range(args.rounds):
                for name, graph in graphs.items():
                    for _ in range(3):
                        graph(q, visible)
                    calls = []
                    for _ in range(30):
                        start = time.perf_counter()
                        graph(q, visible)
                        calls.append(time.perf_counter() - start)
                    times[name].append(statistics.median(calls) * 1e6 / LAYERS)
            us = {name: statistics.median(t) for name, t in times.items()}
            gbs = {name: 2 * keys * HEAD_DIM * 4 / t / 1e3 for name, t in us.items()}
            print(
                f"| {keys} | {us['bmm']:.1f} | {us['fused']:.1f} | {gbs['bmm']:.1f} | "
                f"{gbs['fused']:.1f} | {us['bmm'] / us['fused']:.2f}x |"
            )


if __name__ == "__main__":
    main()
