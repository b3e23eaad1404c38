"""Gemma 1, 2, 3, 3n and 4 text models in one file, with a preallocated, bucket-read KV cache.

The whole contract is ``GemmaForCausalLM.forward(tokens, input_pos, kv_len, rows) -> logits``:
``tokens`` (B, T) are written into the cache at the positions ``input_pos`` (B, T), each batch
row into its own cache row ``rows`` (B,) (the engine's slots), and attention reads only the first
``kv_len`` positions, a Python int the engine rounds up to a bucket so that a compiled graph
serves every length in its bucket. Parameter names are Hugging Face's, so checkpoints load with
no renaming.

Generations differ by config fields on the same modules (see config.py). Only new maths has its
own class, in sparse_blocks.py: the mixture of experts (Router, Experts) of Gemma 4, and AltUp
and LAuReL of Gemma 3n; the products, norms and lookups every layer uses are in layers.py.
Per-layer embeddings (3n, 4) keep their tensors where transformers names them, three on the
model and three on each layer, so they are a method of each (``per_layer_inputs``,
``DecoderLayer.per_layer_term``).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu
from .config import AttentionType, GemmaConfig, RopeConfig
from .layers import (
    Embedding,
    Linear,
    RMSNorm,
    library_attention,
    linear,
    lookup,
    one_query_attention,
    rows_on_cpu_compiled,
)
from .sparse_blocks import AltUp, Experts, Laurel, Router, gaussian_top_k


def rope_table(rope: RopeConfig, head_dim: int, length: int) -> tuple[Tensor, Tensor]:
    """cos and sin, (length, head_dim) in fp32, computed as Hugging Face does."""
    # Proportional RoPE (Gemma 4's full layers) rotates only the first pairs; the rest get
    # frequency 0 (cos 1, sin 0), so the rotate_half layout below passes them through.
    rotated = int(rope.partial_rotary_factor * head_dim // 2)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, 2 * rotated, 2).float() / head_dim))
    inv_freq = F.pad(inv_freq, (0, head_dim // 2 - rotated))
    inv_freq = inv_freq / rope.scaling_factor  # linear scaling interpolates positions
    freqs = torch.outer(torch.arange(length).float(), inv_freq)  # (length, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (length, head_dim): rotate_half layout
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, D); cos, sin: (B, 1, T, D), each row at its own positions
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# Entries a sliding layer's ring holds beyond its window (at most; fewer when the prompt chunk
# is shorter): the most positions one step writes before it reads. A decode step writes one per
# row, a speculative verify step k + 1 <= 17; a longer prompt chunk reads the ring first.
RING_SLACK = 32


def reads_first(length: int, kv_len: int, window: int | None, ring: int) -> bool:
    """Whether a sliding layer reads its ring before writing ``length`` new positions: when
    they are more than the ring holds beyond the window, and positions have wrapped (kv_len >
    ring; below that each position has its own entry)."""
    return window is not None and length > ring - window and kv_len > ring


def stored(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Keys or values in the cache's dtype; in float16's finite range, so that an outlier is
    kept as its largest value rather than as inf (whose scores would be nan)."""
    if t.dtype == dtype:
        return t
    if dtype == torch.float16:
        t = t.clamp(-65504.0, 65504.0)
    return t.to(dtype)


class KVCache(nn.Module):
    """One layer's keys and values for ``batch`` sequences (cache rows), written in place.

    A global layer's row holds ``max_seq_len`` positions, position p at index p. A sliding
    layer's row is a ring of ``slots`` entries, position p at p % slots, sized by the engine
    to the window plus ``RING_SLACK`` (or one prompt chunk, if shorter). A step is written
    before it is read when it fits in that slack (a query at its first position still finds
    the window before it): then the compiled decode step updates the ring in place and reads
    it where it lies. A longer prompt chunk (eager) reads a copy of the ring first and attends
    over the ring and the chunk (``reads_first``). The ring used to hold a whole prompt chunk
    (512) beyond the window, and every decode step at 1k positions or more read all of it:
    1024 entries where 544 now hold the window. Prefix reuse may roll a sequence back as far as
    the slack allows (see slots.py). Every write goes to the batch row's own cache row ``rows``.
    The entries may be kept in a narrower dtype than the model computes in (``stored``): then
    attention reads them widened, inside its fused reductions or as a widened copy.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        slots: int,
        head_dim: int,
        window: int | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.window = window
        self.slots = slots
        shape = (batch, heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(
        self, k: Tensor, v: Tensor, input_pos: Tensor, rows: Tensor, kv_len: int
    ) -> tuple[Tensor, Tensor]:
        # k, v: (B, KV, T, D); input_pos: (B, T); rows: (B,)
        index = input_pos if self.window is None else torch.remainder(input_pos, self.slots)
        n = kv_len if self.window is None else min(kv_len, self.slots)
        # One advanced index triple (row, head, position) per new key, on the buffer itself: the
        # same write through a transposed view makes the compiled step copy the whole buffer.
        heads = torch.arange(k.shape[1], device=k.device)[None, :, None]  # (1, KV, 1)
        k, v = stored(k, self.k.dtype), stored(v, self.v.dtype)  # as every read will see them
        if reads_first(k.shape[2], kv_len, self.window, self.slots):
            ring_k, ring_v = self.k.index_select(0, rows), self.v.index_select(0, rows)
            keep = min(k.shape[2], self.slots)  # the chunk's last positions, one per entry
            where = (rows[:, None, None], heads, index[:, None, -keep:])
            self.k.index_put_(where, k[:, :, -keep:])
            self.v.index_put_(where, v[:, :, -keep:])
            return torch.cat([ring_k, k], dim=2), torch.cat([ring_v, v], dim=2)
        where = (rows[:, None, None], heads, index[:, None, :])  # broadcast to (B, KV, T)
        self.k.index_put_(where, k)
        self.v.index_put_(where, v)
        if self.k.shape[0] == 1:
            # One cache row, so rows is [0]: the slice itself, where a gather would copy the
            # keys and values before attention's bmm reads them (int8 step at context 4096:
            # 28.0 -> 25.1 ms, BENCHMARKS.md).
            return self.k[:, :, :n], self.v[:, :, :n]
        # Each batch row reads its own cache row: a gathered copy, which attention's bmm reads.
        keys = self.k[:, :, :n].index_select(0, rows)  # (B, KV, n, D)
        return keys, self.v[:, :, :n].index_select(0, rows)


def attention_masks(
    input_pos: Tensor, kv_len: int, window: int | None, ring: int | None
) -> dict[AttentionType, Tensor]:
    """Boolean masks (B, 1, T, S), True where a query may attend, for both layer kinds.

    Masks compare positions, never cache indices, so stale entries left by an earlier, longer
    sequence in the same cache row are hidden without clearing it. A sliding layer's ring of
    ``ring`` entries was written up to each row's last position before it is read, so entry i
    holds the latest position congruent to i: ``last - (last - i) % ring``. A chunk that reads
    the ring first (``reads_first``) sees it as written up to the position before the chunk,
    followed by the chunk's own keys.
    """
    q_pos = input_pos[:, :, None]  # (B, T, 1)
    global_pos = torch.arange(kv_len, device=input_pos.device)  # index i holds position i
    masks = {AttentionType.GLOBAL: (global_pos <= q_pos)[:, None]}
    if window is not None:
        first = reads_first(input_pos.shape[1], kv_len, window, ring)
        slots = torch.arange(min(kv_len, ring), device=input_pos.device)
        last = input_pos[:, :1] - 1 if first else input_pos[:, -1:]  # (B, 1)
        key_pos = last - torch.remainder(last - slots, ring)  # (B, S)
        if first:
            key_pos = torch.cat([key_pos, input_pos], dim=1)  # (B, ring + T)
        key_pos = key_pos[:, None, :]  # (B, 1, S)
        visible = (key_pos >= 0) & (key_pos <= q_pos) & (key_pos > q_pos - window)
        masks[AttentionType.SLIDING] = visible[:, None]  # negative: never written
    return masks


# Keys and values of this step by producing layer, for KV-shared layers (Gemma 3n/4) to read.
SharedKV = dict[int, tuple[Tensor, Tensor]]


class Attention(nn.Module):
    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.layers[layer_idx]
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
        # A KV-shared layer computes only queries; keys and values are kv_source's, this step.
        self.kv_source = spec.kv_source
        self.owns_kv = spec.kv_source == layer_idx
        self.feeds_others = any(s.kv_source == layer_idx != j for j, s in enumerate(config.layers))
        self.k_eq_v = spec.k_eq_v
        self.q_proj = Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        if self.owns_kv:
            self.k_proj = Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
            if not self.k_eq_v:
                self.v_proj = Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config)
            if self.owns_kv:
                self.k_norm = RMSNorm(self.head_dim, config)
        if config.v_norm and self.owns_kv:
            self.v_norm = RMSNorm(self.head_dim, config, scale=False)
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.cache: KVCache | None = None  # attached by GemmaForCausalLM.setup_cache

    def forward(
        self,
        x: Tensor,
        input_pos: Tensor,
        rows: Tensor,
        kv_len: int,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        shared: SharedKV,
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if self.config.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        if self.owns_kv:
            k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
            # attention_k_eq_v: the values are the raw key projection (before k_norm and rope).
            v = k if self.k_eq_v else self.v_proj(x).view(B, T, self.n_kv, -1).transpose(1, 2)
            if self.config.qk_norm:
                k = self.k_norm(k)
            if self.config.v_norm:
                v = self.v_norm(v)
            keys, values = self.cache.update(apply_rope(k, cos, sin), v, input_pos, rows, kv_len)
            if self.feeds_others:
                shared[self.layer_idx] = keys, values  # (B, KV, S, D)
        else:
            keys, values = shared[self.kv_source]

        if T > 1 and self.config.attn_logit_softcapping is None:
            # A prompt: PyTorch's fused attention (flash on CPU), which never materialises the
            # (T, S) probabilities; Gemma 2's soft-capping needs the explicit form below.
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # a narrower cache (kv_dtype)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True
            )  # (B, H, T, D)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        # Grouped heads share a key head: fold the group into the query length, no repeat.
        group = self.n_heads // self.n_kv
        q = q.reshape(B, self.n_kv, group * T, self.head_dim)  # (B, KV, G*T, D)
        if rows_on_cpu_compiled(x) and q.dtype == torch.float32:
            # A decode step on CPU: fused reductions over the cache, on both threads, where
            # MKL ran each small product mostly on one (the default model's int8 step on an
            # AMD EPYC: at 128, 10.9 -> 9.8 ms; at 4096, 15.3-16.3 -> 13.9-14.1; BENCHMARKS.md).
            cap = self.config.attn_logit_softcapping
            out = one_query_attention(q, keys, values, mask, self.scaling, cap)
            return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))
        # Elsewhere (CUDA, bf16, eager, several positions), library products.
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = library_attention(
            q, keys, values, mask, self.scaling, self.config.attn_logit_softcapping
        )
        out = out.view(B, self.n_heads, T, self.head_dim).transpose(1, 2)  # (B, T, H, D)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        spec = config.layers[layer_idx]
        self.gate_proj = Linear(config.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = Linear(spec.intermediate_size, config.hidden_size, bias=False)
        # Gemma 3n's activation sparsity keeps the gate values above mean + z * std, z the
        # standard normal quantile of the target sparsity: a constant, computed once here.
        sparsity = spec.activation_sparsity
        self.sparsity_z = NormalDist().inv_cdf(sparsity) if sparsity > 0 else None

    def forward(self, x: Tensor) -> Tensor:
        # GeGLU with the tanh approximation of GELU, as Gemma was trained.
        gate = self.gate_proj(x)
        if self.sparsity_z is not None:
            gate = gaussian_top_k(gate, self.sparsity_z)
        return self.down_proj(F.gelu(gate, approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.sandwich = config.sandwich_norms
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config, layer_idx)
        self.input_layernorm = RMSNorm(hidden, config)
        # Gemma 1 calls its pre-MLP norm "post_attention_layernorm"; Gemma 2+ add a real one.
        self.post_attention_layernorm = RMSNorm(hidden, config)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, config)
            self.post_feedforward_layernorm = RMSNorm(hidden, config)
        self.moe = config.num_experts > 0
        if self.moe:  # Gemma 4: experts beside the dense MLP, with norms of their own
            self.router = Router(config)
            self.experts = Experts(config)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, config)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, config)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, config)
        self.per_layer_input = config.hidden_size_per_layer_input > 0
        if self.per_layer_input:
            width = config.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear(hidden, width, bias=False)
            self.per_layer_projection = Linear(width, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, config)
        self.altup = AltUp(config) if config.altup_num_inputs else None
        self.laurel = Laurel(config) if config.laurel_rank else None
        if config.layer_scalar:  # Gemma 4: a stored scale of the layer's output
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None

    def forward(
        self,
        x: Tensor,
        input_pos: Tensor,
        rows: Tensor,
        kv_len: int,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        shared: SharedKV,
        per_layer_input: Tensor | None = None,
    ) -> Tensor:
        """x (B, T, hidden), or with AltUp (Gemma 3n) its streams (N, B, T, hidden)."""
        if self.altup is not None:
            streams = self.altup.predict(x)
            x = streams[self.altup.active]
        h = self.input_layernorm(x)
        attn = self.self_attn(h, input_pos, rows, kv_len, cos, sin, mask, shared)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        if self.laurel is not None:
            x = (x + self.laurel(h)) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.feed_forward(x))
        if self.altup is not None:
            streams = self.altup.correct(streams, x)
            # Gemma 3n adds the per-layer term to streams 1.. only, as transformers does.
            term = self.per_layer_term(self.altup.scaled_active(streams), per_layer_input)
            streams[1:] += term
            return streams
        if self.per_layer_input:
            x = x + self.per_layer_term(x, per_layer_input)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        return x

    def feed_forward(self, x: Tensor) -> Tensor:
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if not self.moe:
            return h
        # Gemma 4: the router and the experts read the residual, not the dense MLP's input.
        flat = x.reshape(-1, x.shape[-1])  # (B*T, hidden)
        weights, experts = self.router(flat)
        moe = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts)
        moe = self.post_feedforward_layernorm_2(moe.view(x.shape))
        return self.post_feedforward_layernorm_1(h) + moe

    def per_layer_term(self, x: Tensor, per_layer_input: Tensor) -> Tensor:
        """The per-layer embedding's contribution: a GELU gate of x times this layer's input."""
        gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh")
        return self.post_per_layer_input_norm(self.per_layer_projection(gate * per_layer_input))


class GemmaModel(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config)
        if width := config.hidden_size_per_layer_input:  # per-layer embeddings (3n, 4)
            total = config.num_hidden_layers * width
            self.embed_tokens_per_layer = Embedding(config.vocab_size_per_layer_input, total)
            self.per_layer_model_projection = Linear(config.hidden_size, total, bias=False)
            self.per_layer_projection_norm = RMSNorm(width, config)
        if n := config.altup_num_inputs:
            self.altup_projections = nn.ModuleList(
                Linear(config.hidden_size, config.hidden_size, bias=False) for _ in range(n - 1)
            )
            self.altup_unembed_projections = nn.ModuleList(
                Linear(config.hidden_size, config.hidden_size, bias=False) for _ in range(n - 1)
            )

    def per_layer_inputs(self, tokens: Tensor, x: Tensor) -> Tensor:
        """Per-layer embeddings (Gemma 3n/4): each layer's input (B, T, layers, width).

        A token's own row of a second embedding table plus a normed projection of its (scaled)
        embedding ``x``, over sqrt(2); layer i adds a gated term of slice i (per_layer_term).
        """
        cfg = self.config
        shape = (*tokens.shape, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
        # Gemma 3n's table has fewer rows than the vocabulary: other ids read row 0, as in HF.
        ids = torch.where(tokens < cfg.vocab_size_per_layer_input, tokens, 0)
        own = lookup(self.embed_tokens_per_layer, ids)
        own = own * torch.tensor(
            cfg.hidden_size_per_layer_input**0.5, dtype=own.dtype, device=own.device
        )
        context = self.per_layer_model_projection(x) * cfg.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.view(shape))
        return (context + own.view(shape)) * 2**-0.5


def ring_size(config: GemmaConfig, max_seq_len: int, chunk: int) -> int:
    """Entries of a sliding layer's ring: the window plus what a step may write before it
    reads (``RING_SLACK``, or the prompt chunk if shorter), capped at the sequence (then
    positions never wrap)."""
    if not config.sliding_window:
        return max_seq_len
    return min(config.sliding_window + min(chunk, RING_SLACK), max_seq_len)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_seq_len = 0
        self.ring = 0  # entries of a sliding layer's ring (setup_cache)
        # Tensor parallelism (parallel.Shard): this rank holds some heads, MLP columns and
        # vocabulary rows; o_proj and down_proj outputs are summed over ranks by hooks.
        self.tp = None
        # An int8 copy of a float output layer for greedy steps (greedy_screen.py), or None.
        self.greedy_screen = None

    def setup_cache(
        self,
        max_seq_len: int,
        batch: int = 1,
        chunk: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Allocate the KV cache of ``batch`` sequences and the rope tables once, on the
        weights' device and dtype (the cache in ``kv_dtype`` if given); sliding rings hold the
        window and ``RING_SLACK`` positions (fewer if ``chunk``, the longest prompt chunk, is
        shorter), or the whole sequence if that is shorter.

        KV-shared layers (Gemma 3n/4) own no cache: they read their source layer's.
        """
        cfg = self.config
        weight = self.model.norm.weight  # embed_tokens.weight may be quantized
        self.max_seq_len = max_seq_len
        self.ring = ring_size(cfg, max_seq_len, max_seq_len if chunk is None else chunk)
        with torch.device(weight.device):
            for layer in self.model.layers:
                attn = layer.self_attn
                if not attn.owns_kv:
                    continue
                window = cfg.sliding_window if layer.layer_type is AttentionType.SLIDING else None
                slots = self.ring if window else max_seq_len
                dtype = kv_dtype or weight.dtype
                attn.cache = KVCache(batch, attn.n_kv, slots, attn.head_dim, window, dtype)
            for name, kind, rope in (
                ("global", AttentionType.GLOBAL, cfg.rope_global),
                ("local", AttentionType.SLIDING, cfg.rope_local),
            ):  # one table per layer type, at that type's head size (Gemma 4: 512 and 256)
                cos, sin = rope_table(rope, cfg.rope_head_dim(kind), max_seq_len)
                self.register_buffer(f"cos_{name}", cos.to(weight.dtype), persistent=False)
                self.register_buffer(f"sin_{name}", sin.to(weight.dtype), persistent=False)

    def forward(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        kv_len: int,
        rows: Tensor | None = None,
        all_logits: bool = False,
    ) -> Tensor:
        """tokens (B, T) at positions input_pos (B, T) or (T,) in cache rows ``rows`` (B,),
        by default 0..B-1 -> logits (B, T or 1, vocab).

        Only the last position's logits are computed unless ``all_logits``: a 262k-word vocabulary
        makes full-sequence logits the largest tensor of a prefill.
        """
        return self.logits(self.hidden(tokens, input_pos, kv_len, rows, all_logits))

    def screened(
        self, tokens: Tensor, input_pos: Tensor, kv_len: int, rows: Tensor | None = None
    ) -> Tensor:
        """A greedy decode step of tokens (B, 1), as ``forward``, through the int8 copy of the
        output layer (greedy_screen.py) -> (B, hidden + vocab + 1), which its ``pick`` reads."""
        return self.greedy_screen(self.hidden(tokens, input_pos, kv_len, rows))

    def hidden(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        kv_len: int,
        rows: Tensor | None = None,
        all_positions: bool = False,
    ) -> Tensor:
        """The final normed hidden states (B, T or 1, hidden), written into the cache on the way."""
        cfg = self.config
        model = self.model
        B, T = tokens.shape
        input_pos = input_pos.expand(B, T)  # one row of positions serves every batch row
        if rows is None:
            rows = torch.arange(B, device=tokens.device)
        if self.tp is None:
            x = lookup(model.embed_tokens, tokens)  # (B, T, hidden)
        else:  # this rank's rows of the vocabulary, summed over ranks
            x = self.tp.embed(model.embed_tokens, tokens)
        # The sqrt(hidden) scale is rounded to the activation dtype first, as in the reference.
        x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype, device=x.device)
        per_layer = model.per_layer_inputs(tokens, x) if cfg.hidden_size_per_layer_input else None
        rope = {  # (B, 1, T, D): each row at its own positions, broadcast over heads
            AttentionType.GLOBAL: (
                self.cos_global[input_pos][:, None],
                self.sin_global[input_pos][:, None],
            ),
            AttentionType.SLIDING: (
                self.cos_local[input_pos][:, None],
                self.sin_local[input_pos][:, None],
            ),
        }
        window = cfg.sliding_window if cfg.has_sliding_layers else None
        masks = attention_masks(input_pos, kv_len, window, self.ring)
        if cfg.altup_num_inputs:
            x = AltUp.spread(x, model.altup_projections)  # (N, B, T, hidden)
        shared: SharedKV = {}
        first_shared = cfg.first_kv_shared_layer
        for i, layer in enumerate(model.layers):
            if i == first_shared and not all_positions and tokens.shape[1] > 1:
                # KV-shared layers write no cache, so when only the last position's logits are
                # wanted they need run only on it (Gemma 4 E2B: 20 of 35 layers).
                x, input_pos = x[..., -1:, :], input_pos[..., -1:]
                per_layer = per_layer[:, -1:] if per_layer is not None else None
                rope = {k: (cos[..., -1:, :], sin[..., -1:, :]) for k, (cos, sin) in rope.items()}
                masks = {k: m[..., -1:, :] for k, m in masks.items()}
            cos, sin = rope[layer.layer_type]
            ple = per_layer[:, :, i] if per_layer is not None else None
            x = layer(x, input_pos, rows, kv_len, cos, sin, masks[layer.layer_type], shared, ple)
        if cfg.altup_num_inputs:
            x = AltUp.merge(x, model.altup_unembed_projections)  # (B, T, hidden)
        return model.norm(x if all_positions else x[:, -1:])

    def output_layer(self) -> nn.Module:
        """The matrix that maps hidden states to logits: the embedding when they are tied."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def logits(self, x: Tensor) -> Tensor:
        """Normed hidden states (B, T, hidden) -> logits (B, T, vocab)."""
        cfg = self.config
        head = self.output_layer()
        if (
            isinstance(head, nn.Embedding)
            and x.shape[:-1].numel() == 1
            and cpu.LIBRARY_GEMV_FOR_OUTPUT
        ):
            # Tied, float, one token: 63% of Gemma 3 270M's weight bytes. Where the CPU's BLAS
            # streams this matrix faster than the layers' fused multiply-reduce, its GEMV (an
            # extern call inside the graph); cpu.LIBRARY_GEMV_FOR_OUTPUT has the figures.
            logits = F.linear(x, head.weight)  # (1, 1, vocab)
        elif isinstance(head, nn.Embedding):
            logits = linear(x, head.weight)  # (B, T, vocab)
        else:  # Linear, or a quantized matrix that picks its own kernel (quant.py)
            logits = head(x)
        if self.tp is not None:  # this rank's slice of the vocabulary -> all of it
            logits = self.tp.gather_vocab(logits)
        if (cap := cfg.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
