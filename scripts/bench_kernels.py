"""Matrix-vector kernels for one decode token on this machine: which way to multiply quantized
weights is fastest. The matrix is Gemma 3 270M's output layer (262,144 x 640), the largest read
of a decode step; random weights of that shape.

    .venv/bin/python scripts/bench_kernels.py [--rows 262144] [--cols 640] [--repeats 20]

Prints a Markdown table: median milliseconds per call and the weight bytes streamed per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from gemma_engine import quant


def median_ms(fn, *args, repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=262_144)
    p.add_argument("--cols", type=int, default=640)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, k = args.rows, args.cols
    w, x = torch.randn(n, k), torch.randn(1, 1, k)
    q8, s8 = quant.quantize_int8(w)
    q4 = quant.quantize_int4(w, args.group_size)
    fused = lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)  # noqa: E731
    rows = [
        ("fp32, `F.linear` (MKL GEMV)", "fp32", F.linear, (x, w)),
        (
            "fp32, compiled multiply-reduce (the engine)",
            "fp32",
            fused(lambda x, w: (x.unsqueeze(-2) * w).sum(-1)),
            (x, w),
        ),
        (
            "int8, compiled `quant.matvec_int8` (the engine)",
            "int8",
            fused(quant.matvec_int8),
            (x, q8, s8),
        ),
        (
            "int8, `aten._weight_int8pack_mm`",
            "int8",
            torch.ops.aten._weight_int8pack_mm,
            (x.view(1, k), q8, s8),
        ),
        (
            f"int4, compiled `quant.matvec_int4`, groups of {args.group_size} (the engine)",
            "int4",
            fused(quant.matvec_int4),
            (x, *q4),
        ),
    ]
    # PyTorch's packed int4 kernel (groups of 32-256 only), from the same 4-bit values.
    packed, scale, offset = q4
    levels = torch.cat((packed & 15, packed >> 4), dim=1).to(torch.int32)
    int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    scales_zeros = torch.stack((scale.float(), offset.float() + 8 * scale.float()), -1)
    if args.group_size in (32, 64, 128, 256):
        rows.append(
            (
                f"int4, `aten._weight_int4pack_mm_for_cpu`, groups of {args.group_size}",
                "int4",
                torch.ops.aten._weight_int4pack_mm_for_cpu,
                (
                    x.view(1, k),
                    int4pack,
                    args.group_size,
                    scales_zeros.transpose(0, 1).contiguous(),
                ),
            )
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_dynamic's deprecation notice
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = w
        dyn = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8
        )
    rows.append(
        ("int8 weights and activations, fbgemm `quantize_dynamic`", "int8", dyn, (x.view(1, k),))
    )

    print(f"Matrix {n} x {k}, one token, {args.threads} threads, torch {torch.__version__}\n")
    # Each kernel's answer against the product with its own weights expanded to fp32.
    expect = {
        "fp32": F.linear(x, w),
        "int8": F.linear(x, quant.dequantize_int8(q8, s8, torch.float32)),
        "int4": F.linear(x, quant.dequantize_int4(*q4, torch.float32)),
    }
    # Weight bytes per weight: int4 adds a float16 scale and offset per group.
    size = {"fp32": 4, "int8": 1, "int4": 0.5 + 4 / args.group_size}
    print("| kernel | ms per call | weight GB/s | max error / max value |")
    print("| --- | ---: | ---: | ---: |")
    for label, fmt, fn, fn_args in rows:
        ms = median_ms(fn, *fn_args, repeats=args.repeats)
        ref = expect[fmt].flatten()
        err = (fn(*fn_args).flatten() - ref).abs().max() / ref.abs().max()
        gbs = n * k * size[fmt] / ms / 1e6
        print(f"| {label} | {ms:.2f} | {gbs:.1f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
