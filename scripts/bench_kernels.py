"""Matrix-vector kernels for one decode token on this machine: which way to multiply quantized
weights is fastest. The matrix is Gemma 3 270M's output layer (262,144 x 640), the largest read
of a decode step; random weights of that shape.

    .venv/bin/python scripts/bench_kernels.py [--capability avx2] [--rows 262144] [--cols 640]
        [--batch 8] [--contract]

``--capability avx2`` runs the same kernels as an AVX2-only CPU would (see
``_benchutil.LOWERED_ENV``). Prints the machine, the measured read bandwidth and a Markdown
table: median milliseconds per call, the weight bytes streamed per second, and that as a share
of the read bandwidth.

``--batch B`` multiplies B rows at once, as a batched decode step does (issue #11): the
engine's batched products (layers.linear, quant.QuantizedLinear inside a compiled graph) against
a GEMM and fbgemm's dynamic int8. ``--contract`` adds the engine's kernels compiled with
``-ffp-contract=fast`` (inductor's ``cpp.enable_floating_point_contract_flag``): multiply and
add fused into FMA instructions, which changes the rounding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

from gemma_engine import cpu, layers, packed_int8, quant, quant_kernels  # noqa: E402


def median_ms(fn, *args, repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# The engine's kernels before the kernel layout (row-major bytes, git 5ef02a6), for comparison.
def rowmajor_int8(x, q, scale):
    out = (x.reshape(-1, 1, q.shape[1]).float() * q.float()).sum(-1) * scale
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def rowmajor_int4(x, packed, scale, offset):
    n, half = packed.shape
    per_half = scale.shape[1] // 2
    p = packed.view(n, per_half, half // per_half)
    s = scale.float().view(n, 2, per_half, 1)
    o = offset.float().view(n, 2, per_half, 1)
    xg = x.reshape(2, per_half, -1).float()
    lo = (xg[0] * ((p & 15).float() * s[:, 0] + o[:, 0])).sum((-1, -2))
    hi = (xg[1] * ((p >> 4).float() * s[:, 1] + o[:, 1])).sum((-1, -2))
    return (lo + hi).to(x.dtype).view(*x.shape[:-1], n)


def one_row(args, fused, x, w, q8, s8, q4, lanes, words8, blocked4) -> list:
    """The single-token kernels: what a decode step of one sequence runs."""
    unit = "int32 words" if words8.dtype == torch.int32 else "int8 bytes"
    n, k = w.shape
    g = args.group_size
    blas = cpu.LIBRARY_GEMV_FOR_OUTPUT  # which of the two the engine's output layer takes here
    rows = [
        (
            "fp32, `F.linear` (MKL GEMV"
            + ("; the engine's output layer on this CPU)" if blas else ")"),
            "fp32",
            F.linear,
            (x, w),
        ),
        (
            "fp32, compiled multiply-reduce (the engine's layers"
            + (")" if blas else ", and its output layer on this CPU)"),
            "fp32",
            fused(lambda x, w: (x.unsqueeze(-2) * w).sum(-1)),
            (x, w),
        ),
        ("int8, compiled, row-major bytes (before)", "int8", fused(rowmajor_int8), (x, q8, s8)),
        (
            f"int8, compiled, {unit} blocked by {lanes} rows (the engine's layers)",
            "int8",
            fused(quant_kernels.matvec_int8),
            (x, words8, s8),
        ),
        (
            "int8, `aten._weight_int8pack_mm`",
            "int8",
            torch.ops.aten._weight_int8pack_mm,
            (x.view(1, k), q8, s8),
        ),
        (
            f"int4 g{g}, compiled, row-major nibbles (before)",
            "int4",
            fused(rowmajor_int4),
            (x, *q4),
        ),
        (
            f"int4 g{g}, compiled, int32 words blocked by {lanes} rows (the engine)",
            "int4",
            fused(lambda x, *t: quant_kernels.matvec_int4(x, *t, n)),
            (x, *blocked4),
        ),
    ]
    # PyTorch's packed int4 kernel (groups of 32-256 only), from the same 4-bit values.
    packed, scale, offset = q4
    levels = torch.cat((packed & 15, packed >> 4), dim=1).to(torch.int32)
    if g in (32, 64, 128, 256):
        int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        scales_zeros = torch.stack((scale.float(), offset.float() + 8 * scale.float()), -1)
        rows.append(
            (
                f"int4 g{g}, `aten._weight_int4pack_mm_for_cpu`",
                "int4",
                torch.ops.aten._weight_int4pack_mm_for_cpu,
                (x.view(1, k), int4pack, g, scales_zeros.transpose(0, 1).contiguous()),
            )
        )
    return rows


def engine_int8(q8, s8, lanes: int) -> quant.Int8Linear:
    """The engine's int8 layer (kernel layout) over these weights."""
    layer = quant.Int8Linear(q8.shape[1], q8.shape[0], torch.float32)
    layer.weight, layer.scale = q8.clone(), s8
    layer.to_kernel_layout(lanes)
    return layer


def batched_rows(args, fused, x, w, q8, s8, lanes) -> list:
    """B rows at once: the engine's batched decode products against a GEMM."""
    int8 = engine_int8(q8, s8, lanes)
    return [
        ("fp32, `F.linear` (MKL GEMM)", "fp32", F.linear, (x, w)),
        (
            "fp32, compiled multiply-reduce per row, fused (the engine)",
            "fp32",
            fused(layers.linear),
            (x, w),
        ),
        ("int8, compiled per-row kernels, stacked (the engine)", "int8", fused(int8), (x,)),
    ]


def contracted(args, fused, x, w, q8, s8, lanes, words8) -> list:
    """The engine's kernels again, compiled with multiply-add contracted to FMA."""
    unit = "int32 words" if words8.dtype == torch.int32 else "int8 bytes"
    if args.batch == 1:
        return [
            (
                "fp32, compiled multiply-reduce, FMA",
                "fp32",
                fused(lambda x, w: (x.unsqueeze(-2) * w).sum(-1), "fast"),
                (x, w),
            ),
            (
                f"int8, compiled, {unit} blocked, FMA",
                "int8",
                fused(quant_kernels.matvec_int8, "fast"),
                (x, words8, s8),
            ),
        ]
    int8 = engine_int8(q8, s8, lanes)
    return [
        (
            "fp32, compiled multiply-reduce per row, fused, FMA",
            "fp32",
            fused(layers.linear, "fast"),
            (x, w),
        ),
        ("int8, compiled per-row kernels, stacked, FMA", "int8", fused(int8, "fast"), (x,)),
    ]


def library_rows(x, q8, s8) -> list:
    """The int8 output layer's path where a GEMM library serves the capability
    (gemma_engine/packed_int8.py): each library's integer GEMM on 7-bit activation rows."""
    rows = []
    engine = packed_int8.backend()
    for library in ("onednn", "fbgemm"):
        if library not in torch.backends.quantized.supported_engines:
            continue
        q = q8.clone()  # each library's packed copy rides on its own tensor
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fbgemm packing's quantized-tensor notice
            packed_int8.pack(q, s8, library)
        mark = " (the engine's output layer)" if library == engine else ""
        label = f"int8, {library} integer GEMM on {packed_int8.ROWS} 7-bit rows{mark}"
        rows.append((label, "int8", packed_int8.product, (x, q)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capability", choices=["native", "avx2"], default="native")
    p.add_argument("--rows", type=int, default=262_144)
    p.add_argument("--cols", type=int, default=640)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="rows multiplied at once")
    p.add_argument("--contract", action="store_true", help="also the engine's kernels with FMA")
    args = p.parse_args()
    bu.reexec_lowered(args.capability)
    cpu.isolate_compile_cache()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, k = args.rows, args.cols
    w, x = torch.randn(n, k), torch.randn(args.batch, 1, k)
    q8, s8 = quant.quantize_int8(w)
    q4 = quant.quantize_int4(w, args.group_size)
    lanes = cpu.vector_lanes()
    # the engine's layout here
    words8 = quant_kernels.block_int8(q8, lanes, quant_kernels.int8_words())
    blocked4 = quant_kernels.block_int4(*q4, lanes)

    def fused(fn, contract: str = "off"):
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        fma = {"cpp.enable_floating_point_contract_flag": contract}

        def call(*a):
            # as the engine compiles its graphs (plus the contraction flag)
            with cpu.compile_config(), torch._inductor.config.patch(fma):
                return compiled(*a)

        return call

    if args.batch > 1:
        rows = batched_rows(args, fused, x, w, q8, s8, lanes)
    else:
        rows = one_row(args, fused, x, w, q8, s8, q4, lanes, words8, blocked4)
    if args.contract:
        rows += contracted(args, fused, x, w, q8, s8, lanes, words8)

    rows += library_rows(x, q8, s8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_dynamic's deprecation notice
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = w
        dyn = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8
        )
    rows.append(
        ("int8 weights and activations, fbgemm `quantize_dynamic`", "int8", dyn, (x.view(-1, k),))
    )

    info = bu.machine_info("cpu", args.threads)
    bw = bu.measure_bandwidth("cpu")
    print(f"Machine: {bu.machine_line(info)}; {info['date_utc']}")
    print(f"Versions: torch {torch.__version__}, gemma-engine git {info['git']}")
    print(
        f"Read bandwidth (sum over 1 GiB, median of {bw['repeats']}): {bw['read_gbs']:.1f} GB/s\n"
    )
    what = "one token" if args.batch == 1 else f"{args.batch} rows"
    print(f"Matrix {n} x {k}, {what}, {args.threads} threads\n")
    # Each kernel's answer against the product with its own weights expanded to fp32.
    expect = {
        "fp32": F.linear(x, w).double(),
        "int8": F.linear(x, quant.dequantize_int8(q8, s8, torch.float32)).double(),
        "int4": F.linear(x, quant.dequantize_int4(*q4, torch.float32)).double(),
    }
    # Weight bytes per weight: int4 adds a float16 scale and offset per group.
    g = args.group_size
    size = {"fp32": 4, "int8": 1, "int4": 0.5 + 4 / g}
    print(
        "| kernel | ms per call | weight GB/s | share of read bandwidth | max error / max value |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, fmt, fn, fn_args in rows:
        ms = median_ms(fn, *fn_args, repeats=args.repeats)
        ref = expect[fmt].flatten()
        err = (fn(*fn_args).flatten().double() - ref).abs().max() / ref.abs().max()
        gbs = n * k * size[fmt] / ms / 1e6
        share = gbs / bw["read_gbs"]
        print(f"| {label} | {ms:.2f} | {gbs:.1f} | {share:.0%} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
