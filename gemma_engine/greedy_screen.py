"""Exact greedy decoding that reads an int8 copy of a float output layer, not the layer itself.

A greedy step needs one thing from the output layer: which row of it scores highest. Gemma 3
270M's tied 262,144 x 640 output layer is 671 MB in fp32, 63% of the bytes a decode step
reads. Its int8 copy (per-row scales, quant.quantize_int8) is a quarter of that, and bounds
every fp32 logit: with ``q`` the int8 row and ``s`` its scale, each weight is within ``s / 2``
of ``s * q``, so the logit of row n is within ``s_n / 2 * ||h||_1`` of the int8 product (h the
normed hidden state). A row whose upper bound is below the best lower bound cannot be the
argmax. So the screened decode graph (``GemmaForCausalLM.screened``) computes the int8
products and each row's upper bound, plus the best lower bound, and ``pick`` computes the fp32
logits of the few rows that pass (on the default model a median of 14 of 262,144, at most 66
over a page of text) from the float weights, and takes their argmax.

The margin also covers float32 rounding of both products and of the bound itself (``slack``),
so every row left out has a computed fp32 logit strictly below the best candidate's: the token
is the argmax of the fp32 logits, as ``sampling.greedy`` of the full logits gives, ties going
to the lower id. The candidates' logits are summed in another order than the full product's,
so two logits within a float32 rounding of each other may tie differently, as any two fp32
kernels may. A row whose hidden state holds a NaN or an infinity has no candidate and gets its
full logits, as does one whose capped logits (Gemma 2's final softcap) flatten out so far that a
row left out could tie with the best.

Used for greedy requests that ask for no logprobs, on CPU engines with compiled decode and a
float32 output layer of at least ``MIN_BYTES``. A sampled request, or one that wants
logprobs, runs the plain graph with every logit. The int8 copy is kept between processes in
the quantized-weight cache (quantized_cache.py) like an int8 model's weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu, quant, quant_kernels, quantized_cache
from .layers import materialized
from .sampling import greedy

MIN_BYTES = 64 << 20  # smaller float output layers are read fast enough as they are
CACHE_METHOD = "greedy-screen-int8"  # the quantized-weight cache's name for the copy


def slack(width: int) -> float:
    """Each row's margin per unit of s_n * ||h||_1 for hidden states of ``width`` features.

    1/2 for the rounding to int8 (each weight within s_n/2 of s_n * q, and q = round(w / s_n)
    rounds w / s_n itself by at most 127 units in the last place: the relative 2**-10 covers it
    and the rounding of ||h||_1). Then float32 rounding: the int8 product and a candidate's
    float logit are each a sum of K = ``width`` terms of at most 127 s_n |h_k|, so each is within
    (K + 1) * 2**-24 * 127 s_n ||h||_1 of its exact value; twice both, which also covers the
    bound's own few operations. 0.52 for Gemma 3 270M's 640 features, 0.66 for 5376.
    """
    return 0.5 * (1 + 2**-10) + 4 * 127 * (width + 1) * 2**-24


class GreedyScreen(nn.Module):
    """The int8 copy of the output layer in the decode kernels' layout, its scales, and each
    row's margin per unit of ||h||_1. Buffers, not state: never saved with the model, and
    read by the saved decode graphs in place like the model's other tensors."""

    def __init__(self, q: Tensor, scale: Tensor) -> None:
        super().__init__()
        vocab, width = q.shape
        self.vocab, self.width = vocab, width
        blocks = quant_kernels.block_int8(q, cpu.vector_lanes(), words=quant_kernels.int8_words())
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("scale", scale.float(), persistent=False)
        self.register_buffer("margin", scale.float() * slack(width), persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        """Normed hidden states (B, 1, K) -> (B, K + V + 1): each row's hidden state, the upper
        bounds of its V logits, and the best lower bound. One tensor: a saved graph has one
        output. Runs inside a compiled decode graph (the one-token int8 kernel)."""
        B = hidden.shape[0]
        h = materialized(hidden.reshape(B, self.width))
        approx = quant_kernels.matvec_int8_rows(h, self.blocks, self.scale)  # (B, V)
        error = self.margin * h.abs().sum(-1, keepdim=True)  # (B, V)
        floor = (approx - error).amax(-1, keepdim=True)
        return torch.cat([h, approx + error, floor], dim=-1)

    def pick(self, screened: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
        """The greedy tokens (B,) from the screened graph's output and the float output layer
        ``weight`` (V, K): the argmax of the fp32 logits (softcapped if the model caps them)."""
        K, V = self.width, self.vocab
        h, high, floor = screened[:, :K], screened[:, K : K + V], screened[:, K + V :]
        rows, cols = (high >= floor).nonzero(as_tuple=True)  # row-major: ids ascending
        exact = (weight[cols] * h[rows]).sum(-1)
        logits = torch.full((h.shape[0], V), float("-inf"), device=h.device)
        logits[rows, cols] = exact if softcap is None else _capped(exact, softcap)
        missing = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
        missing[rows] = False
        if softcap is not None:
            # tanh flattens: far enough out, a row left out (its logit below the floor) could
            # round to the same capped value as the best and, with a lower id, win the tie.
            # Unless the best is clearly above the floor's capped value, the full logits.
            limit = _capped(floor[:, 0], softcap) + softcap * 2**-20
            missing |= ~(logits.amax(-1) > limit)
        if missing.any():  # NaN or infinite bounds, or a capped tie: these rows in full
            full = F.linear(h[missing], weight)
            logits[missing] = full if softcap is None else _capped(full, softcap)
        return greedy(logits)


def _capped(logits: Tensor, softcap: float) -> Tensor:
    return torch.tanh(logits / softcap) * softcap  # as GemmaForCausalLM.logits caps them


def wanted(model: nn.Module, device: torch.device, compiled: bool) -> bool:
    """Whether ``model`` gets a screen by default: a CPU engine with compiled decode and a
    float32 output layer of ``MIN_BYTES`` or more, not sharded over ranks."""
    head = model.output_layer()
    sharded = model.tp is not None
    return possible(head, head.weight.dtype, device, compiled, sharded) is None and (
        head.weight.numel() * 4 >= MIN_BYTES
    )


def possible(
    head: nn.Module, dtype: torch.dtype | None, device: torch.device, compiled: bool, sharded: bool
) -> str | None:
    """Why a model whose output layer is ``head``, its weights in ``dtype`` (None: they will be
    quantized), cannot have a screen, or None when it can. ``head`` may be the model's meta
    skeleton's (loading.load asks before placing any weight)."""
    if device.type != "cpu":
        return f"it runs on CPU engines (this one is on {device.type})"
    if not compiled:
        return "it runs inside compiled decode graphs (this engine is eager)"
    if sharded:
        return "it does not run under tensor parallelism"
    if not isinstance(head, (nn.Linear, nn.Embedding)) or dtype != torch.float32:
        return "it screens a float32 output layer (this one is quantized or in another dtype)"
    if head.weight.shape[1] % 4:  # the int8 kernel's words (quant_kernels.block_int8)
        return f"it needs a hidden size that is a multiple of 4, not {head.weight.shape[1]}"
    return None


def attach(model: nn.Module, path: Path | None) -> None:
    """Give ``model`` its screen, the int8 copy read from the quantized-weight cache entry of
    the checkpoint at ``path`` or quantized now (and kept there)."""
    weight = model.output_layer().weight
    entry = quantized_cache.Entry(path, CACHE_METHOD, None, weight.dtype) if path else None
    found = entry.read() if entry is not None else None
    if found is not None and _fits(found, weight):
        q, scale = found["weight"], found["scale"]
    else:
        q, scale = quant.quantize_int8(weight.detach())
        if entry is not None:
            entry.write({"weight": q, "scale": scale})
    model.greedy_screen = GreedyScreen(q, scale)


def _fits(found: dict[str, Tensor], weight: Tensor) -> bool:
    q, scale = found.get("weight"), found.get("scale")
    return (
        set(found) == {"weight", "scale"}
        and q.dtype == torch.int8
        and q.shape == weight.shape
        and scale.dtype == torch.float32
        and scale.shape == weight.shape[:1]
    )
