"""B rows times one weight matrix in a compiled CPU graph: the forms a batched decode step could
use for its products (the microbenchmark behind layers.BATCHED_FUSED). Not a test.

fp32: ``fused`` (the one-token form, rows outer), ``fused_inner`` (rows inside each weight row:
what the engine uses), ``gemm`` (F.linear). int8, in the engine's kernel layout: ``per_row``
(the one-token kernel once per row: what the engine uses), ``fused_inner`` (rows inside each
weight block), ``dequant_gemm`` (expand the matrix, then F.linear).

    .venv/bin/python scripts/bench_batched_products.py [--shapes 2048x640,65536x640] [--batches 2,8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemma_engine import cpu, quant, quant_kernels  # noqa: E402


def fused(x, w):
    return (x.unsqueeze(-2) * w).sum(-1)


def fused_inner(x, w):
    rows = x.reshape(-1, x.shape[-1])
    return (w[:, None, :] * rows[None]).sum(-1).T


def gemm(x, w):
    return F.linear(x, w)


def i8_per_row(x, words, scale):
    return quant_kernels.matvec_int8_rows(x.reshape(-1, x.shape[-1]), words, scale)  # the engine's


def i8_fused_inner(x, words, scale):
    nb, kw, lanes = words.shape
    rows = x.reshape(-1, x.shape[-1])
    x4 = rows.reshape(rows.shape[0], kw, 4).float()
    acc = sum(
        (x4[None, :, :, j, None] * quant_kernels._top_byte(words, j).float()[:, None]).sum(2)
        for j in range(4)
    )  # (nb, R, L), times 2**24
    out = acc.transpose(0, 1).reshape(rows.shape[0], nb * lanes)[:, : scale.shape[0]]
    return out * (scale * quant_kernels.WORD_UNSCALE)


def i8_dequant_gemm(x, q, scale):
    return F.linear(x.reshape(-1, x.shape[-1]), q.float() * scale[:, None])


def milliseconds(fn, *args) -> float:
    step = torch.compile(fn, fullgraph=True, dynamic=False)
    with torch.no_grad(), cpu.compile_config():
        step(*args)
        step(*args)
        reps = 20 if args[1].numel() < 5e6 else 5
        start = time.perf_counter()
        for _ in range(reps):
            step(*args)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="2048x640,65536x640", help="N x K weight matrices")
    p.add_argument("--batches", default="2,8")
    args = p.parse_args()
    torch.manual_seed(0)
    lanes = cpu.vector_lanes()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k) * 0.05
        q, scale = quant.quantize_int8(w)
        # the engine's layout here
        words = quant_kernels.block_int8(q, lanes, quant_kernels.int8_words())
        word_blocks = quant_kernels.block_int8(q, lanes)  # i8_fused_inner reads words on any CPU
        x = torch.randn(1, 1, k)
        one = (milliseconds(fused, x, w), milliseconds(i8_per_row, x, words, scale))
        print(f"N={n} K={k} B=1: fp32 fused {one[0]:.3f} ms, int8 kernel {one[1]:.3f} ms")
        for b in (int(v) for v in args.batches.split(",")):
            x = torch.randn(b, 1, k)
            fp32 = {f.__name__: milliseconds(f, x, w) for f in (fused, fused_inner, gemm)}
            int8 = {
                "per_row": milliseconds(i8_per_row, x, words, scale),
                "fused_inner": milliseconds(i8_fused_inner, x, word_blocks, scale),
                "dequant_gemm": milliseconds(i8_dequant_gemm, x, q, scale),
            }
            cols = [f"fp32 {k_} {v:.3f}" for k_, v in fp32.items()]
            cols += [f"int8 {k_} {v:.3f}" for k_, v in int8.items()]
            print(f"N={n} K={k} B={b}: " + ", ".join(cols) + " (ms)", flush=True)


if __name__ == "__main__":
    main()
