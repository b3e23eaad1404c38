"""The building blocks every layer uses: products that pick their kernel, lookups, norms.

On CPU inside a compiled decode graph, products are fused multiply-reduces rather than library
calls (see ``linear``); elsewhere they are the usual ``F.linear`` / ``matmul``. The model
(model.py) and the quantized modules (quant.py) share these predicates, so that a float and a
quantized layer take the same decision for the same step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import GemmaConfig


def one_token_on_cpu_compiled(x: Tensor) -> bool:
    """A decode step of one sequence on CPU inside a compiled graph, where the layers'
    matrix-vector products are fused multiply-reduces: inductor streamed a layer's matrix
    through them 1.3-4x faster than MKL's GEMV (BENCHMARKS.md), and a quantized matrix is
    expanded in the same pass (the output layer is the exception: see model.logits)."""
    return x.shape[:-1].numel() == 1 and x.device.type == "cpu" and torch.compiler.is_compiling()


def rows_on_cpu_compiled(x: Tensor) -> bool:
    """A decode step (x: (..., B, 1, K), one new position per row) on CPU inside a compiled
    graph. ``linear`` takes it for B > 1 (one row is ``one_token_on_cpu_compiled``'s);
    attention for any B (``one_query_attention``)."""
    return x.shape[-2] == 1 and x.device.type == "cpu" and torch.compiler.is_compiling()


# A batched decode step's products on CPU: True, one multiply-reduce per batch row over the same
# weights, fused into one loop (each weight is read once from memory, the few rows stay in cache;
# see linear); False, F.linear (a GEMM). In a microbenchmark on the project's 2-core machine
# (under load: see the report of issue 11) the fused form was 1.3-3x faster at B = 2, 4, 8 for
# Gemma 3 270M's shapes, its 262k-row output matrix included (scripts/bench_batched_products.py);
# scripts/bench_batch.py --batched-linear gemm measures the other choice end to end.
BATCHED_FUSED = True


def materialized(x: Tensor) -> Tensor:
    """``x``, written to a buffer of its own inside a compiled graph.

    A fused multiply-reduce reads its input once per output row. Left to itself, inductor
    inlines whatever computed that input (a norm, attention's softmax for o_proj) into the
    reduction and computes it again for every row: for a decode step of Gemma 3 270M that was
    the RMSNorm's scaling, six operations per weight element, recomputed in every projection.
    A strided view (a no-op outside the graph) makes inductor store the input first.
    """
    x = x.contiguous()
    return x.as_strided(x.shape, x.stride())


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T, as a fused multiply-reduce for decode steps in a compiled CPU graph."""
    if one_token_on_cpu_compiled(x):
        x = materialized(x)
        return (x.unsqueeze(-2) * weight).sum(-1)  # (..., 1, K) * (N, K) -> (..., N)
    if BATCHED_FUSED and rows_on_cpu_compiled(x):
        # Inlined into the reduction, the rows' norm made the default model's B=2 step take
        # 1.78 s instead of 49 ms (see materialized).
        rows = materialized(x.reshape(-1, x.shape[-1]))  # (R, K)
        # One reduction per row over the same weights, which inductor fuses into one loop:
        # each weight vector is loaded once for all rows. As one (N, R, K) product, inductor
        # ran the rows one after another over each weight row: 36 matrices of 2048 x 640 on
        # an AVX2 Zen 3 took 17.5 ms for 5 rows (9.3 ms this way), 23.3 for 4 (9.1), 47.7
        # for 16 (33.2), against 5.9 ms for one row (BENCHMARKS.md, 2026-12-07).
        out = torch.stack([(row * weight).sum(-1) for row in rows], -1)  # R x (N, K) -> (N, R)
        return out.T.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def batched_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., K) times each row's own matrix weight (..., N, K) -> (..., N): gathered experts.

    In a compiled CPU graph a fused multiply-reduce, as ``linear``, that reads the gathered
    rows in place; elsewhere a batched matmul over a copy of them (a few tokens' worth).
    """
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        return (x.unsqueeze(-2) * weight).sum(-1)  # (..., 1, K) * (..., N, K) -> (..., N)
    return torch.matmul(weight, x.unsqueeze(-1)).squeeze(-1)


def library_attention(
    q: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scaling: float, cap: float | None
) -> Tensor:
    """Attention through library products (bmm): q (B, KV, G*T, D), the G query heads that
    share each key head folded into the query length; keys and values (B, KV, S, D); visible
    (B, 1, T, S). Returns (B, KV, G*T, D).

    The scores are computed as keys @ q^T, the cache as the product's left matrix, read as it
    lies: MKL's small products with the cache transposed on the right ran 2.4-3.8x slower on an
    AMD EPYC, under AVX-512 and lowered to AVX2 (1,024 keys: 193 against 51 us under AVX-512;
    the int8 step at 4096 then, 18.5 -> 14.5 ms; BENCHMARKS.md).
    """
    B, KV, _, _ = q.shape
    T = visible.shape[-2]
    scores = torch.matmul(keys, q.transpose(2, 3)).transpose(2, 3) * scaling
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap  # Gemma 2 caps before masking
    scores = scores.view(B, KV, -1, T, scores.shape[-1])  # (B, KV, G, T, S)
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(B, KV, q.shape[2], -1), values)


def one_query_attention(
    q: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scaling: float, cap: float | None
) -> Tensor:
    """Attention of one query position per head, as fused reductions inside the graph.

    q: (B, KV, G, D), the G query heads that share each key head; keys and values: (B, KV, S,
    D); visible: (B, 1, 1, S). Returns (B, KV, G, D). One reduction per query head, all over the
    same keys, which inductor fuses into one loop that reads each key once (as it fuses a
    product's row groups, see quant_kernels.matvec_int8), and both threads share it; MKL ran these
    small products mostly on one thread. The weights are normalised after the weighted sum, once per
    output: inlined into that sum, the division ran once per key and output vector, a scalar
    division that cost as much as the product. The same sums in another order: not bit for
    bit the bmm path's outputs.
    """
    q = materialized(q)  # else the norm and rope are computed again for every key
    heads = q.shape[2]
    scores = torch.stack([(keys * q[:, :, g, None, :]).sum(-1) for g in range(heads)], dim=2)
    scores = scores * scaling  # (B, KV, G, S)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap  # Gemma 2 caps before masking
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = materialized(torch.exp(scores - scores.amax(-1, keepdim=True)))
    out = torch.stack(
        [(weights[:, :, g, :, None] * values).sum(2) for g in range(heads)], dim=2
    )  # (B, KV, G, D)
    return out / weights.sum(-1, keepdim=True)


def lookup(table: nn.Module, tokens: Tensor) -> Tensor:
    """Rows of an embedding table, float or quantized (see quant.py)."""
    return table(tokens) if isinstance(table, nn.Embedding) else table.embed(tokens)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """Nothing: see Embedding."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """Nothing: the model is built on the meta device and given a checkpoint's tensors
        (loading.build_model), and torch's random initializers, run on meta tensors, import
        Dynamo (0.9 s), which a process that loads its saved graphs never needs otherwise
        (saved_graphs.py)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, config: GemmaConfig, scale: bool = True) -> None:
        super().__init__()
        self.eps, self.offset = config.rms_norm_eps, config.norm_offset
        # Gemma 3n/4's value and router norms have no weight at all.
        self.weight = nn.Parameter(torch.zeros(dim)) if scale else None

    def forward(self, x: Tensor) -> Tensor:
        # Gemma normalises in fp32 and scales by (offset + w), also in fp32, before casting
        # back; Llama-style x.to(dtype) * w would round differently in bf16.
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return out.type_as(x)
        return (out * (self.offset + self.weight.float())).type_as(x)
