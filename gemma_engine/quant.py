"""Weight-only int8 and int4 quantization of the linear layers and the (tied) embedding.

Activations stay in the model's dtype; only weights are stored in fewer bits and expanded on
the fly. A decode step is bound by the bytes of weights it reads (1.07 GB a token for Gemma 3
270M in fp32), so int8 reads a quarter of them and int4 about an eighth.

- int8: one scale per output channel, symmetric: ``w = q * scale`` with q in [-127, 127].
- int4: one scale and one offset per group of ``group_size`` input columns (affine):
  ``w = q * scale + offset`` with q in [0, 15]; two 4-bit values share a byte. Scales and
  offsets are float16, so a group of 32 costs 5 bits per weight.

Decode on CPU multiplies and reduces the quantized weights inside the compiled graph, where
inductor fuses the expansion into one vectorized pass over the weight bytes; PyTorch's own
packed kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) measured 9-12x and 11-16x
slower on the benchmark machine (BENCHMARKS.md). A prompt of many tokens expands each weight
once per call and runs a dense matmul, which amortises the expansion over the tokens.

The embedding is quantized too (it is 63% of Gemma 3 270M's weights): a lookup expands only
the rows it reads, and a tied output layer reuses the same quantized matrix. Under int4 the
embedding and output layer are int8, as llama.cpp's Q4_K_M keeps its output layer in 8 bits for
Gemma 3 270M: quantizing it to int4 as well added about 10 points of perplexity increase (42%
against 32%, groups of 64), and inductor's int4 product is slower than its int8 one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import InvalidRequestError
from .model import one_token_on_cpu_compiled

METHODS = ("none", "int8", "int4")
DEFAULT_GROUP_SIZE = 32
QUANT_BUFFERS = (".scale", ".offset")  # stored in their own dtypes, never cast on load
CONFIG_KEY = "gemma_engine_quantization"  # config.json entry of a saved quantized model


def check_quantize(
    method: str | None, group_size: int | None, widths: list[int]
) -> tuple[str, int | None]:
    """Validate a request against the model's input widths: (method, int4 group size)."""
    method = method or "none"
    if method not in METHODS:
        raise InvalidRequestError(f"quantize must be one of {', '.join(METHODS)}, got {method!r}")
    if group_size is not None and method != "int4":
        raise InvalidRequestError("group_size applies only to quantize='int4'")
    if method != "int4":
        return method, None
    if group_size is None:  # the default, or the largest power of two below it that fits
        group_size = DEFAULT_GROUP_SIZE
        while group_size > 2 and any(k % (2 * group_size) for k in widths):
            group_size //= 2
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise InvalidRequestError(f"group_size must be an even number >= 2, got {group_size!r}")
    # Each half of a row (see the packing below) must hold whole groups.
    bad = sorted({k for k in widths if k % (2 * group_size)})
    if bad:
        raise InvalidRequestError(
            f"int4 group_size {group_size} does not fit the model: each layer width "
            f"({', '.join(map(str, bad))}) must be a multiple of 2 x group_size; "
            "choose a smaller power of two such as 32"
        )
    return method, group_size


# -- int8 ----------------------------------------------------------------------------------
def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> int8 (N, K) and fp32 scales (N,), symmetric per output channel."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (q.float() * scale[:, None]).to(dtype)


# -- int4 ----------------------------------------------------------------------------------
# Packing: byte (n, j) of an (N, K/2) matrix holds column j of row n in its low nibble and
# column j + K/2 in its high nibble, so both halves of a row are contiguous runs that line up
# with the two halves of the activation vector.
def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float -> packed uint8 (N, K/2), fp16 scales and offsets (N, K/group_size).

    Each group's offset is its minimum; its step is the range divided by the number of steps
    n <= 15 that reconstructs the group best. n = 15 is plain min-max rounding; a smaller n
    finds the grid of weights that were already quantized (a Q4_K GGUF's sub-blocks of 32
    rarely use all 16 levels), which min-max rounding would blur.
    """
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    offset = lo.half().float()
    best_err, best_scale = None, None
    for steps in range(15, 0, -1):
        scale = ((hi - lo) / steps).clamp(min=1e-8).half().float()
        q = torch.round((groups - offset) / scale).clamp(0, 15)
        err = (q * scale + offset - groups).pow(2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err * (1 - 1e-6)  # a clear improvement, not float noise
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
    q = torch.round((groups - offset) / best_scale).clamp(0, 15).to(torch.uint8).view(n, k)
    packed = q[:, : k // 2] | (q[:, k // 2 :] << 4)
    return packed.contiguous(), best_scale[..., 0].half(), offset[..., 0].half()


def dequantize_int4(packed: Tensor, scale: Tensor, offset: Tensor, dtype: torch.dtype) -> Tensor:
    n, half = packed.shape
    group = 2 * half // scale.shape[1]
    q = torch.cat((packed & 15, packed >> 4), dim=1).float().view(n, -1, group)
    w = q * scale.float()[..., None] + offset.float()[..., None]
    return w.view(n, 2 * half).to(dtype)


def matvec_int4(x: Tensor, packed: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """x (..., K) @ W.T for one token: the two nibbles of a byte multiply the two halves of x.

    Written as two reductions over the same bytes, which inductor fuses into one loop; a
    ``cat`` of the nibbles would be materialised first (measured: slower).
    """
    n, half = packed.shape
    per_half = scale.shape[1] // 2
    group = half // per_half
    p = packed.view(n, per_half, group)
    s = scale.float().view(n, 2, per_half, 1)
    o = offset.float().view(n, 2, per_half, 1)
    xg = x.reshape(2, per_half, group).float()
    lo = (xg[0] * ((p & 15).float() * s[:, 0] + o[:, 0])).sum((-1, -2))
    hi = (xg[1] * ((p >> 4).float() * s[:, 1] + o[:, 1])).sum((-1, -2))
    return (lo + hi).to(x.dtype).view(*x.shape[:-1], n)


# -- modules -------------------------------------------------------------------------------
@functools.cache
def _cpu_bf16_matmul() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _prompt_dtype(x: Tensor) -> torch.dtype:
    """The dtype of a quantized layer's matmul over many tokens.

    On a CPU with bf16 matmul support (AVX512-BF16, AMX) an fp32 model's quantized layers
    multiply in bf16, 2.3-3x faster than fp32 (BENCHMARKS.md): the weights are already
    approximate, and bf16 holds every int8 value exactly. Elsewhere the model's dtype.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and _cpu_bf16_matmul():
        return torch.bfloat16
    return x.dtype


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features))

    def forward(self, x: Tensor) -> Tensor:
        if one_token_on_cpu_compiled(x):
            return matvec_int8(x, self.weight, self.scale)
        dtype = _prompt_dtype(x)
        w = dequantize_int8(self.weight, self.scale, dtype)
        return F.linear(x.to(dtype), w).to(x.dtype)

    def embed(self, tokens: Tensor) -> Tensor:
        """Rows of the matrix for ``tokens``: the lookup of a quantized embedding."""
        return (self.weight[tokens].float() * self.scale[tokens][..., None]).to(self.dtype)


def matvec_int8(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (..., K) @ W.T for one token: int8 expanded and reduced in one fused pass."""
    out = (x.reshape(-1, 1, q.shape[1]).float() * q.float()).sum(-1) * scale
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])


class Int4Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, group_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        groups = in_features // group_size
        self.register_buffer(
            "weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        )
        self.register_buffer("scale", torch.empty(out_features, groups, dtype=torch.float16))
        self.register_buffer("offset", torch.empty(out_features, groups, dtype=torch.float16))

    def forward(self, x: Tensor) -> Tensor:
        if one_token_on_cpu_compiled(x):
            return matvec_int4(x, self.weight, self.scale, self.offset)
        dtype = _prompt_dtype(x)
        w = dequantize_int4(self.weight, self.scale, self.offset, dtype)
        return F.linear(x.to(dtype), w).to(x.dtype)

    def embed(self, tokens: Tensor) -> Tensor:
        """Rows of the matrix for ``tokens``: the lookup of a quantized embedding."""
        rows = self.weight[tokens]  # (..., K/2)
        w = torch.cat((rows & 15, rows >> 4), dim=-1).float()
        groups = self.scale.shape[1]
        w = w.view(*tokens.shape, groups, -1)
        w = w * self.scale[tokens].float()[..., None] + self.offset[tokens].float()[..., None]
        return w.view(*tokens.shape, self.in_features).to(self.dtype)


def quantize_model(
    model: nn.Module, method: str, group_size: int | None, dtype: torch.dtype
) -> None:
    """Replace every linear layer and the embedding of ``model`` with ``method``'s modules.

    Weights on the meta device give empty modules (to be filled by a strict state-dict load
    of a saved quantized checkpoint); real weights are quantized here, one layer at a time.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                n, k = child.out_features, child.in_features
            elif isinstance(child, nn.Embedding):
                n, k = child.num_embeddings, child.embedding_dim
            else:
                continue
            w = child.weight
            # The output layer (the tied embedding) stays int8 under int4: it is the layer
            # perplexity is most sensitive to, and its int8 product is also the faster one.
            output = isinstance(child, nn.Embedding) or name == "lm_head"
            with torch.device(w.device):
                if method == "int8" or output:
                    new = Int8Linear(k, n, dtype)
                    tensors = None if w.is_meta else quantize_int8(w)
                else:
                    new = Int4Linear(k, n, group_size, dtype)
                    tensors = None if w.is_meta else quantize_int4(w, group_size)
            if tensors is not None:
                names = ("weight", "scale", "offset")[: len(tensors)]
                for buf, t in zip(names, tensors, strict=True):
                    setattr(new, buf, t)
            setattr(parent, name, new)
