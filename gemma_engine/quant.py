"""Weight-only int8 and int4 quantization of the linear layers and the (tied) embedding.

Activations stay in the model's dtype; only weights are stored in fewer bits and expanded on
the fly. A decode step is bound by the bytes of weights it reads (1.07 GB a token for Gemma 3
270M in fp32), so int8 reads a quarter of them and int4 about an eighth.

- int8: one scale per output channel, symmetric: ``w = q * scale`` with q in [-127, 127].
- int4: one scale and one offset per group of ``group_size`` input columns (affine):
  ``w = q * scale + offset`` with q in [0, 15]. Scales and offsets are float16, so a group of
  32 costs 5 bits per weight.

Two layouts. The *saved* layout (what ``state_dict`` and safetensors hold) is the plain one:
int8 rows (N, K), and for int4 two nibbles per byte, (N, K/2). The *kernel* layout, made once
at load, is what the decode kernels read: quant_kernels.py has both, and why.

Decode on CPU runs these products inside the compiled graph. A prompt of many tokens expands
each weight once per call and runs a dense matmul, which amortises the expansion over the
tokens.

The embedding is quantized too (it is 63% of Gemma 3 270M's weights): a lookup expands only
the rows it reads, and a tied output layer reuses the same quantized matrix. Under int4 the
embedding and output layer are int8, as llama.cpp's Q4_K_M keeps its output layer in 8 bits for
Gemma 3 270M: quantizing it to int4 as well added about 10 points of perplexity increase (42%
against 32%, groups of 64).

Gemma 3n/4: their new linear layers (per-layer embedding gates and projections, LAuReL, AltUp's
stream projections) are quantized like any other, and the per-layer embedding table (Gemma 4
E2B's largest tensor) like the embedding, int8 under both methods. A few tiny matrices stay in
float (``KEEP_FLOAT``). Mixture-of-experts experts (Gemma 4 26B-A4B) are refused: their 3-D
weights would need gathered kernels of their own in the layout above.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu, packed_int8
from .errors import CheckpointError, InvalidRequestError
from .layers import materialized, one_token_on_cpu_compiled, rows_on_cpu_compiled
from .quant_kernels import (
    block_int4,
    block_int8,
    int8_words,
    matvec_int4,
    matvec_int8,
    matvec_int8_rows,
    unblock_int4,
    unblock_int8,
)
from .sparse_blocks import Experts

METHODS = ("none", "int8", "int4")
DEFAULT_GROUP_SIZE = 32
QUANT_BUFFERS = (".scale", ".offset")  # stored in their own dtypes, never cast on load
CONFIG_KEY = "gemma_engine_quantization"  # config.json entry of a saved quantized model
# Capabilities whose quantized decode kernels are measured faster than fp32 (BENCHMARKS.md).
FAST_CAPABILITIES = ("AVX2", "AVX512")
# Linear layers left in float: AltUp's coefficient maps have 4 inputs (no int8 word or int4
# group fits), its modality router 4 outputs, and the MoE router decides which experts run,
# which rounding could flip. All are tiny.
KEEP_FLOAT = (
    "altup.prediction_coefs",
    "altup.correction_coefs",
    "altup.modality_router",
    "router.proj",
)


def _quantized_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, child) for each linear layer and embedding that quantization replaces."""
    found = []
    for path, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, (nn.Linear, nn.Embedding)):
                if not f"{path}.{name}".endswith(KEEP_FLOAT):
                    found.append((parent, name, child))
    return found


def input_widths(model: nn.Module) -> list[int]:
    """The input widths of the layers quantization would replace (check_quantize's widths)."""
    return sorted(
        {
            c.in_features if isinstance(c, nn.Linear) else c.embedding_dim
            for _, _, c in _quantized_children(model)
        }
    )


def check_supported(model: nn.Module, method: str) -> None:
    """Refuse a quantization of a model with parts it does not cover."""
    if method != "none" and any(isinstance(m, Experts) for m in model.modules()):
        raise InvalidRequestError(
            f"quantize={method!r} does not cover the experts of a mixture-of-experts model "
            "(Gemma 4 26B-A4B); load it without quantize (--quantize none)"
        )


def check_saved(config: dict) -> None:
    """The quantization entry save_pretrained writes into config.json, if there is one."""
    saved = config.get(CONFIG_KEY)
    if saved is None:
        return
    group = saved.get("group_size") if isinstance(saved, dict) else None
    if (
        not isinstance(saved, dict)
        or saved.get("method") not in METHODS[1:]
        or not (group is None or type(group) is int and 8 <= group <= 1 << 16)
    ):
        raise CheckpointError(
            f"config.json: {CONFIG_KEY} is {saved!r:.80}; save_pretrained writes "
            '{"method": "int8" or "int4", "group_size": null or a multiple of 8}'
        )


def check_quantize(
    method: str | None, group_size: int | None, widths: list[int]
) -> tuple[str, int | None]:
    """Validate a request against the model's input widths: (method, int4 group size)."""
    method = method or "none"
    if method not in METHODS:
        raise InvalidRequestError(f"quantize must be one of {', '.join(METHODS)}, got {method!r}")
    if group_size is not None and method != "int4":
        raise InvalidRequestError("group_size applies only to quantize='int4'")
    bad = sorted({k for k in widths if k % 8})
    if method != "none" and bad:
        raise InvalidRequestError(
            f"{method} needs layer widths that are multiples of 8; this model has "
            f"{', '.join(map(str, bad))}"
        )
    if method != "int4":
        return method, None
    if group_size is None:  # the default, or the largest power of two below it that fits
        group_size = DEFAULT_GROUP_SIZE
        while group_size > 8 and any(k % (2 * group_size) for k in widths):
            group_size //= 2
    if not isinstance(group_size, int) or group_size < 8 or group_size % 8:
        raise InvalidRequestError(
            f"group_size must be a multiple of 8 (8, 16, 32, ...), got {group_size!r}"
        )
    # Each half of a saved row (see the packing below) must hold whole groups.
    bad = sorted({k for k in widths if k % (2 * group_size)})
    if bad:
        raise InvalidRequestError(
            f"int4 group_size {group_size} does not fit the model: each layer width "
            f"({', '.join(map(str, bad))}) must be a multiple of 2 x group_size; "
            "choose a smaller power of two such as 32"
        )
    return method, group_size


_warned: set[str] = set()


def warn_if_slow(method: str, device: torch.device) -> None:
    """Say once, on stderr, when a quantized decode has no fast kernel on this device."""
    if method == "none":
        return
    if device.type == "cpu" and cpu.capability() in FAST_CAPABILITIES:
        return
    where = f"CPU capability {cpu.capability()}" if device.type == "cpu" else device.type
    if where in _warned:
        return
    _warned.add(where)
    print(
        f"gemma-engine: warning: {method} decode has no fast kernel on {where} (it expands "
        "the weights at every step and may be slower than unquantized weights); "
        "measure with and without --quantize",
        file=sys.stderr,
    )


# -- int8 ----------------------------------------------------------------------------------
def quantize_int8(
    w: Tensor, row_max: Callable[[Tensor], Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """(N, K) float -> int8 (N, K) and fp32 scales (N,), symmetric per output channel.

    ``row_max`` maps the rows' absolute maxima to those of the whole rows, when ``w`` holds
    only some of the columns (tensor parallelism: see parallel.Shard.row_max).
    """
    w = w.float()
    # One pass for the maxima and one temporary for the quotients, rounded and clamped in
    # place: the same values as abs().amax() and round(w / scale).clamp(), in 0.8 s instead of
    # 1.2-1.8 s for the default model's output layer (a fresh int8 process quantizes at load).
    low, high = torch.aminmax(w, dim=1)
    amax = torch.maximum(-low, high)
    if row_max is not None:
        amax = row_max(amax)
    scale = amax.clamp(min=1e-12) / 127
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (q.float() * scale[:, None]).to(dtype)


# -- int4 ----------------------------------------------------------------------------------
# Saved packing: byte (n, j) of an (N, K/2) matrix holds column j of row n in its low nibble and
# column j + K/2 in its high nibble.
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


# -- modules -------------------------------------------------------------------------------
@functools.cache
def _cpu_bf16_matmul() -> bool:
    # oneDNN asks the CPU itself, so the capability is checked too: a process lowered to AVX2
    # must take the path an AVX2 machine takes.
    return (
        cpu.capability() == "AVX512"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _prompt_dtype(x: Tensor) -> torch.dtype:
    """The dtype of a quantized layer's matmul over many tokens.

    On a CPU with bf16 matmul support (AVX512-BF16, AMX) an fp32 model's quantized layers
    multiply in bf16, 2.3-3x faster than fp32 (BENCHMARKS.md): the weights are already
    approximate, and bf16 holds every int8 value exactly. Elsewhere the model's dtype.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and _cpu_bf16_matmul():
        return torch.bfloat16
    return x.dtype


class QuantizedLinear(nn.Module):
    """Shared behaviour: the layout switch, saving in the plain layout, the prompt path."""

    lanes: int | None = None  # None: the saved layout; else rows blocked by this many lanes
    packed: bool = False  # with a library's packed copy for several rows (packed_int8.py)

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # The dtype's name, not the dtype: torch 2.13's saving of a compiled graph's guards
        # (Dynamo's ahead-of-time compile, which saved_graphs.py used before AOTInductor)
        # marks the unread attributes of a module as missing by object identity, and dtypes
        # are singletons, so an unread dtype attribute turned every tensor of that dtype in the
        # saved guards into a "missing" value that does not load.
        self._dtype_name = str(dtype).removeprefix("torch.")

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self._dtype_name)

    def forward(self, x: Tensor) -> Tensor:
        if self.lanes is not None and one_token_on_cpu_compiled(x):
            return self.matvec(materialized(x))
        if self.packed and x.device.type == "cpu" and x.shape[:-1].numel() <= packed_int8.MAX_ROWS:
            return packed_int8.product(x, self.weight, self.out_features)
        if self.lanes is not None and rows_on_cpu_compiled(x):
            # A batched decode step: the one-token kernel per row, which inductor fuses over
            # the rows (B = 8 measured ~1.3x one row's time, against ~12x for expanding the
            # matrix and a GEMM); each row's arithmetic is exactly its solo step's.
            rows = materialized(x.reshape(-1, x.shape[-1]))  # see layers.materialized
            return self.matvec_rows(rows).view(*x.shape[:-1], -1)
        dtype = _prompt_dtype(x)
        return F.linear(x.to(dtype), self.dequantize(dtype)).to(x.dtype)

    def matvec_rows(self, rows: Tensor) -> Tensor:
        """rows (R, K) -> (R, N): the one-token kernel per row, fused over the rows."""
        return torch.stack([self.matvec(row) for row in rows])

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        # Checkpoints always hold the plain layout, whatever this CPU's kernels use.
        for name, tensor in self.saved_tensors().items():
            destination[prefix + name] = tensor if keep_vars else tensor.detach()


class Int8Linear(QuantizedLinear):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features))

    def to_kernel_layout(self, lanes: int) -> None:
        packed = getattr(self.weight, "_gemma_packed", None)
        self.weight = block_int8(self.weight, lanes, words=int8_words())
        if packed is not None:
            self.weight._gemma_packed = packed
        self.lanes = lanes

    def pack(self) -> None:
        """Attach a GEMM library's packed copy (packed_int8.py) to the plain weight, which
        to_kernel_layout then blocks, keeping the copy: products of a few rows (a batched
        step, an eager one) go through it. Packing the plain matrix spares rebuilding it from
        the blocked one (0.17 s of a fresh process's start for the default model's output
        layer)."""
        if self.lanes is not None:
            raise RuntimeError("Int8Linear.pack: pack the plain weight, before to_kernel_layout")
        packed_int8.pack(self.weight, self.scale)
        self.packed = True

    def saved_tensors(self) -> dict[str, Tensor]:
        q = self.weight if self.lanes is None else unblock_int8(self.weight, self.out_features)
        return {"weight": q, "scale": self.scale}

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        q = self.weight if self.lanes is None else unblock_int8(self.weight, self.out_features)
        return dequantize_int8(q, self.scale, dtype)

    def matvec(self, x: Tensor) -> Tensor:
        return matvec_int8(x, self.weight, self.scale)

    def matvec_rows(self, rows: Tensor) -> Tensor:
        return matvec_int8_rows(rows, self.weight, self.scale)

    def embed(self, tokens: Tensor) -> Tensor:
        """Rows of the matrix for ``tokens``: the lookup of a quantized embedding."""
        q, scale = self.rows(tokens)
        return (q.float() * scale[..., None]).to(self.dtype)

    def rows(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The int8 rows (..., K) of ``tokens`` and their scales (...), in either layout."""
        if self.lanes is None:
            return self.weight[tokens], self.scale[tokens]
        # Row t is column t % L of block t // L (words or bytes).
        cols = self.weight[tokens // self.lanes, :, tokens % self.lanes]  # (..., K')
        return cols.contiguous().view(torch.int8), self.scale[tokens]

    def set_rows(self, rows: Tensor, q: Tensor, scale: Tensor) -> None:
        """Write int8 rows ``q`` (n, K) and their scales (n,) at ``rows`` (n,), in place: a
        compiled graph keeps reading these tensors."""
        if self.lanes is None:
            self.weight[rows] = q
        else:
            self.weight[rows // self.lanes, :, rows % self.lanes] = q.view(self.weight.dtype)
        self.scale[rows] = scale


class Int4Linear(QuantizedLinear):
    def __init__(
        self, in_features: int, out_features: int, group_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__(in_features, out_features, dtype)
        groups = in_features // group_size
        self.register_buffer(
            "weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        )
        self.register_buffer("scale", torch.empty(out_features, groups, dtype=torch.float16))
        self.register_buffer("offset", torch.empty(out_features, groups, dtype=torch.float16))

    def to_kernel_layout(self, lanes: int) -> None:
        self.weight, self.scale, self.offset = block_int4(
            self.weight, self.scale, self.offset, lanes
        )
        self.lanes = lanes

    def saved_tensors(self) -> dict[str, Tensor]:
        if self.lanes is None:
            return {"weight": self.weight, "scale": self.scale, "offset": self.offset}
        packed, scale, offset = unblock_int4(
            self.weight, self.scale, self.offset, self.out_features
        )
        return {"weight": packed, "scale": scale, "offset": offset}

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        t = self.saved_tensors()
        return dequantize_int4(t["weight"], t["scale"], t["offset"], dtype)

    def matvec(self, x: Tensor) -> Tensor:
        return matvec_int4(x, self.weight, self.scale, self.offset, self.out_features)


def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int | None,
    dtype: torch.dtype,
    row_max: Callable[[str, Tensor], Tensor] | None = None,
) -> None:
    """Replace every linear layer and the embedding of ``model`` with ``method``'s modules.

    Weights on the meta device give empty modules (to be filled by a strict state-dict load
    of a saved quantized checkpoint); real weights are quantized here, one layer at a time.
    Either way the modules hold the saved layout until ``to_kernel_layout``. ``row_max(name,
    amax)``: the int8 rows' maxima over every rank (tensor parallelism), by the layer's name.
    """
    check_supported(model, method)
    for parent, name, child in _quantized_children(model):
        if isinstance(child, nn.Linear):
            n, k = child.out_features, child.in_features
        else:
            n, k = child.num_embeddings, child.embedding_dim
        w = child.weight
        # Embeddings (the tied output layer, Gemma 3n/4's per-layer table) stay int8 under int4:
        # the output layer is the one perplexity is most sensitive to, its int8 product is also
        # the faster one, and a table is read only a few rows at a time.
        output = isinstance(child, nn.Embedding) or name == "lm_head"
        with torch.device(w.device):
            if method == "int8" or output:
                new = Int8Linear(k, n, dtype)
                whole = functools.partial(row_max, name) if row_max is not None else None
                tensors = None if w.is_meta else quantize_int8(w, whole)
            else:
                new = Int4Linear(k, n, group_size, dtype)
                tensors = None if w.is_meta else quantize_int4(w, group_size)
        if tensors is not None:
            names = ("weight", "scale", "offset")[: len(tensors)]
            for buf, t in zip(names, tensors, strict=True):
                setattr(new, buf, t)
        setattr(parent, name, new)


def to_kernel_layout(model: nn.Module, output_layer: nn.Module | None = None) -> None:
    """Re-lay every quantized matrix for this process's decode kernels (see the top).

    The int8 ``output_layer``, where a GEMM library is fast on this capability, gets the
    library's packed copy as well (packed_int8.py), for the products of several rows: a
    batched step of 4 rows at context 1024 took 39.8 ms with it, 42.3 ms with inductor's
    kernel. One token keeps inductor's kernel, which reads the blocked matrix faster than the
    libraries now: an int8 step at context 128 took 17.4 against 18.7 ms with oneDNN under
    AVX-512, 21.2 against 25.4 ms with fbgemm under AVX2 (BENCHMARKS.md). The plain matrix is
    not kept: the lookups of a tied embedding read the blocked one. No ``output_layer``, no
    packed copy (the loader's choice for a compiled engine of one sequence, loading.load).
    """
    lanes = cpu.vector_lanes()
    for module in model.modules():
        if not isinstance(module, QuantizedLinear) or module.lanes is not None:
            continue
        if module is output_layer and isinstance(module, Int8Linear) and packed_int8.backend():
            module.pack()
        module.to_kernel_layout(lanes)
