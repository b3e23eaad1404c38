"""The int8 output layer's product through PyTorch's integer GEMM libraries (oneDNN, fbgemm).

Inductor's int8 kernels (quant_kernels.matvec_int8) widen every weight byte to a float in vector
registers before multiplying: on the project's AVX-512 VM the 262,144 x 640 output layer of
Gemma 3 270M streamed at 48% of read bandwidth that way (a hand-written four-accumulator FMA
loop reached 61%), about half of an int8 decode step. oneDNN and fbgemm multiply bytes with
integer dot-product instructions (VNNI/AMX, AVX2's vpmaddubsw): with the four activation rows
below, 8.6 against 13.2 ms per token under AVX-512 (70% of bandwidth) and 12.7 against 20.6 ms
under AVX2 (scripts/bench_kernels.py). One library call per step costs ~20 us of dispatch, so
only the output layer takes this path; the layers' small matrices stay in the graph, where
the same call per layer measured slower end to end (BENCHMARKS.md, issue #14).

Since inductor's kernel reads four groups of rows side by side (quant_kernels.matvec_int8), it
streams one token's product faster than both libraries (quant.to_kernel_layout has the
figures): the packed copy now serves the products of several rows (batched steps) and eager calls.

The libraries multiply uint8 activations by int8 weights. To keep the engine's int8 mode the
exact product of its quantized weights (the tests compare it with transformers on the expanded
weights), each activation row is split into ``ROWS`` = 4 rows of integers in [-64, 64]:

    x = step * (q0 + q1 / 128 + q2 / 128**2 + q3 / 128**3) + e,    |e| <= step / 2 / 128**3,

with ``step`` a power of two chosen per row so that |x| <= 64 * step; every scaling is then
exact, and e is below 2**-28 of the row's largest value (float32 itself keeps 2**-24; three
rows, 2**-21, measured 1e-5 relative error on rows with an outlier). The library sums integers
exactly in int32 (|sum| <= K * 128 * 127 < 2**31 for any K here), and with the zero point 64 the
uint8 values stay in [0, 128], so AVX2's 16-bit pair sums cannot saturate (2 * 128 * 127 <
2**15). Each row's result depends on that row alone: a batched step computes every row exactly
as its solo step does. Four rows cost little: the weights are read once for all of them.

The packed copy lives on the weight tensor itself (``weight._gemma_packed``), so it dies with
it; the blocked int8 matrix (quant.to_kernel_layout) stays for one token's product, the
embedding lookups and the prompt path.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from . import cpu

ROWS = 4  # integer rows per activation row: 7 bits each, 28 in all
ZERO_POINT = 64  # uint8 = integer + 64, in [0, 128]
MAX_ROWS = 8  # activation rows per call; more (a prompt) take the dequantized GEMM


@functools.cache
def backend() -> str | None:
    """The library for this process's CPU capability, or None where neither is fast.

    oneDNN under AVX-512 (VNNI or AMX where present; 8.6 ms for the output layer against
    fbgemm's 9.9 ms), fbgemm under AVX2 (12.7 ms against oneDNN's 74 ms). The capability, not
    the CPU, so that a process lowered to AVX2 takes the AVX2 machine's path.
    """
    engines = torch.backends.quantized.supported_engines
    capability = cpu.capability()
    if (
        capability == "AVX512"
        and "onednn" in engines
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
    ):
        return "onednn"
    # fbgemm is reached through quantized tensors, which torch 2.13 marks deprecated: a torch
    # without them keeps inductor's kernel (quant_kernels.matvec_int8) for the output layer too.
    if (
        capability in ("AVX2", "AVX512")
        and "fbgemm" in engines
        and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")
    ):
        return "fbgemm"
    return None


def pack(weight: Tensor, scale: Tensor, library: str | None = None) -> None:
    """Attach the library's packed copy of ``weight`` (int8 (N, K), fp32 scales (N,))."""
    library = library or backend()
    n, k = weight.shape
    zeros = torch.zeros(n, dtype=torch.long)  # the weights' zero points: symmetric int8
    if library == "onednn":
        packed = torch.ops.onednn.qlinear_prepack(weight, [1, k])
        weight._gemma_packed = ("onednn", packed, scale.float(), zeros)
    elif library == "fbgemm":
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_channel_quantized_tensor(weight, scale.double(), zeros, 0)
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"  # prepack follows the global engine
        try:
            packed = torch.ops.quantized.linear_prepack(q, None)
        finally:
            torch.backends.quantized.engine = previous
        weight._gemma_packed = ("fbgemm", packed)
    else:
        raise ValueError(f"no int8 GEMM library {library!r}")


def _library_product(ints: Tensor, weight: Tensor, n: int) -> Tensor:
    """ints (M, K) float holding integers in [-64, 64] -> (M, N): ints @ (int8 * scale).T,
    the int8 matrix being the one packed onto ``weight`` (of any layout), N = ``n``."""
    packed = getattr(weight, "_gemma_packed", None)
    if packed is None:
        raise RuntimeError("packed_int8: this int8 matrix has no packed copy (call pack first)")
    if packed[0] == "onednn":
        _, matrix, scale, zeros = packed
        u8 = (ints + ZERO_POINT).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(
            u8, 1.0, ZERO_POINT, matrix, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        ints.contiguous(), 1.0, ZERO_POINT, packed[1]
    )


# The same as an operator a compiled graph can call. Eager calls skip it: torch runs a custom
# operator's body under a Dynamo guard whose first call imports Dynamo (1.2 s, the first
# prompt's logits of every fresh int8 process, which loads its graphs without it).
_product = torch.library.custom_op("gemma_engine::packed_int8_product", mutates_args=())(
    _library_product
)


@_product.register_fake
def _(ints: Tensor, weight: Tensor, n: int) -> Tensor:
    return ints.new_empty(ints.shape[0], n)


def product(x: Tensor, weight: Tensor, n: int | None = None) -> Tensor:
    """x (..., K) @ (int8 weight * scale).T through the packed copy (see the top); ``n``, the
    matrix's rows, defaults to the weight's first dimension (the saved layout's)."""
    k, n = x.shape[-1], weight.shape[0] if n is None else n
    rows = x.reshape(-1, k).float()
    amax = rows.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    step = torch.exp2(torch.ceil(torch.log2(amax / 64)))  # (M, 1), a power of two
    step = torch.where(amax > 64 * step, 2 * step, step)  # should log2 round down
    r = rows / step
    parts = []
    for _ in range(ROWS):
        q = torch.round(r).clamp(-64, 64)
        parts.append(q)
        r = (r - q) * 128  # exact: |r - q| <= 1/2 and the scaling is by a power of two
    ints = torch.stack(parts, 1).reshape(-1, k)  # (M * ROWS, K)
    call = _product if torch.compiler.is_compiling() else _library_product
    out = call(ints, weight, n).view(rows.shape[0], ROWS, n)
    acc = out[:, ROWS - 1]
    for i in range(ROWS - 2, -1, -1):  # the smallest parts first
        acc = out[:, i] + acc / 128
    return (acc * step).to(x.dtype).view(*x.shape[:-1], n)
