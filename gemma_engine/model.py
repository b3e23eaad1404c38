"""Gemma 1, 2 and 3 text models in one file, with a preallocated, bucket-read KV cache.

The whole contract is ``GemmaForCausalLM.forward(tokens, input_pos, kv_len) -> logits``:
``tokens`` (B, T) are written into the cache at the positions ``input_pos`` (T,), and attention
reads only the first ``kv_len`` cache slots, a Python int the engine rounds up to a bucket so
that a compiled graph serves every length in its bucket. Parameter names are Hugging Face's, so
checkpoints load with no renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import AttentionType, GemmaConfig, RopeConfig


def one_token_on_cpu_compiled(x: Tensor) -> bool:
    """A decode step on CPU inside a compiled graph, where matrix-vector products are fused
    multiply-reduces: inductor streams a weight matrix through them 1.3-4x faster than MKL's
    GEMV does (BENCHMARKS.md), and a quantized matrix is expanded in the same pass."""
    return x.shape[:-1].numel() == 1 and x.device.type == "cpu" and torch.compiler.is_compiling()


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T, as a fused multiply-reduce for one token in a compiled CPU graph."""
    if one_token_on_cpu_compiled(x):
        return (x.unsqueeze(-2) * weight).sum(-1)  # (..., 1, K) * (N, K) -> (..., N)
    return F.linear(x, weight)


def matmul(a: Tensor, b: Tensor, fused: bool) -> Tensor:
    """a (..., M, K) @ b (..., K, N); ``fused``: as one multiply-reduce inside the graph.

    A decode step's attention products are tiny batched matrix products (a few query rows
    against one head's keys), for which a ``bmm`` call costs more in dispatch than in
    arithmetic (4.6 ms of a 20 ms step, BENCHMARKS.md); inductor fuses the reduction form
    with the mask and the softmax around it.
    """
    if fused:
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)  # (..., M, K, 1) * (..., 1, K, N)
    return torch.matmul(a, b)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Gemma normalises in fp32 and scales by (1 + w), also in fp32, before casting back;
        # Llama-style x.to(dtype) * w would round differently in bf16.
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def rope_table(rope: RopeConfig, head_dim: int, length: int) -> tuple[Tensor, Tensor]:
    """cos and sin, (length, head_dim) in fp32, computed as Hugging Face does."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    inv_freq = inv_freq / rope.scaling_factor  # linear scaling interpolates positions
    freqs = torch.outer(torch.arange(length).float(), inv_freq)  # (length, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (length, head_dim): rotate_half layout
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, D); cos, sin: (T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache(nn.Module):
    """One layer's keys and values, preallocated and written in place.

    A global layer owns ``max_seq_len`` slots and slot i holds position i. A sliding layer owns
    only ``window`` slots used as a ring (position p lives in slot p % window). For a chunk of
    several tokens it returns the ring as it was before this call's write, followed by the new
    keys, so that a chunk longer than the window still sees every key it needs; a single decode
    token is written first and the ring is read in place.
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
        shape = (batch, heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, k: Tensor, v: Tensor, input_pos: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        # k, v: (B, KV, T, D)
        if self.window is None:
            self.k.index_copy_(2, input_pos, k)
            self.v.index_copy_(2, input_pos, v)
            return self.k[:, :, :kv_len], self.v[:, :, :kv_len]  # (B, KV, kv_len, D)
        if k.shape[2] == 1:
            # Decode: write first, then read the ring in place. The slot written held a position
            # a whole window back, which this query no longer sees. (Reading before writing, as
            # a chunk must, makes the compiled step copy every ring to keep the old values.)
            slot = torch.remainder(input_pos, self.window)
            self.k.index_copy_(2, slot, k)
            self.v.index_copy_(2, slot, v)
            n = min(kv_len, self.window)
            return self.k[:, :, :n], self.v[:, :, :n]  # (B, KV, n, D)
        n_ring = ring_length(kv_len, k.shape[2], self.window)
        keys = torch.cat((self.k[:, :, :n_ring], k), dim=2)  # (B, KV, n_ring + T, D)
        values = torch.cat((self.v[:, :, :n_ring], v), dim=2)
        n_new = min(k.shape[2], self.window)  # older keys of a long chunk would be overwritten
        slots = torch.remainder(input_pos[-n_new:], self.window)
        self.k.index_copy_(2, slots, k[:, :, -n_new:])
        self.v.index_copy_(2, slots, v[:, :, -n_new:])
        return keys, values


def ring_length(kv_len: int, chunk: int, window: int) -> int:
    """Ring slots a chunk of ``chunk`` new tokens must read: the positions before it.

    Those are fewer than ``kv_len - chunk`` (the bucket holds the chunk's end) and a window at
    most, so a prompt's first chunk reads no ring at all.
    """
    return min(kv_len - chunk, window)


def attention_masks(
    input_pos: Tensor, kv_len: int, window: int | None
) -> dict[AttentionType, Tensor]:
    """Boolean masks (T, S), True where a query may attend, for both layer kinds.

    Masks compare positions, never slot indices, so stale slots left by an earlier, longer
    generation are hidden without clearing the cache.
    """
    q_pos = input_pos[:, None]  # (T, 1)
    global_pos = torch.arange(kv_len, device=input_pos.device)  # slot i holds position i
    masks = {AttentionType.GLOBAL: global_pos[None, :] <= q_pos}
    if window is not None:
        decode = input_pos.shape[0] == 1  # decode reads the ring after writing (KVCache.update)
        if decode:
            n_ring, last = min(kv_len, window), input_pos[0]
        else:  # a chunk reads the ring as it was, then its own keys
            n_ring, last = ring_length(kv_len, input_pos.shape[0], window), input_pos[0] - 1
        slots = torch.arange(n_ring, device=input_pos.device)
        ring_pos = last - torch.remainder(last - slots, window)  # negative: never written
        key_pos = (ring_pos if decode else torch.cat((ring_pos, input_pos)))[None, :]
        masks[AttentionType.SLIDING] = (
            (key_pos >= 0) & (key_pos <= q_pos) & (key_pos > q_pos - window)
        )
    return masks


class Attention(nn.Module):
    def __init__(self, config: GemmaConfig, layer_type: AttentionType) -> None:
        super().__init__()
        self.config = config
        self.layer_type = layer_type
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.cache: KVCache | None = None  # attached by GemmaForCausalLM.setup_cache

    def forward(
        self, x: Tensor, input_pos: Tensor, kv_len: int, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = self.cache.update(k, v, input_pos, kv_len)  # (B, KV, S, D)

        if T > 1 and self.config.attn_logit_softcapping is None:
            # A prompt: PyTorch's fused attention (flash on CPU), which never materialises the
            # (T, S) probabilities; Gemma 2's soft-capping needs the explicit form below.
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True
            )  # (B, H, T, D)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        # Grouped heads share a key head: fold the group into the query length, no repeat.
        group = self.n_heads // self.n_kv
        q = q.reshape(B, self.n_kv, group * T, self.head_dim)  # (B, KV, G*T, D)
        fused = one_token_on_cpu_compiled(x)  # products as fused reductions, as in linear()
        scores = matmul(q, keys.transpose(2, 3), fused) * self.scaling  # (B, KV, G*T, S)
        if (cap := self.config.attn_logit_softcapping) is not None:
            scores = torch.tanh(scores / cap) * cap  # Gemma 2 caps before masking
        scores = scores.view(B, self.n_kv, group, T, -1).masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = probs.view(B, self.n_kv, group * T, -1)
        out = matmul(probs, values, fused)  # (B, KV, G*T, D)
        out = out.view(B, self.n_heads, T, self.head_dim).transpose(1, 2)  # (B, T, H, D)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # GeGLU with the tanh approximation of GELU, as Gemma was trained.
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: GemmaConfig, layer_type: AttentionType) -> None:
        super().__init__()
        self.sandwich = config.sandwich_norms
        self.layer_type = layer_type
        self.self_attn = Attention(config, layer_type)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Gemma 1 calls its pre-MLP norm "post_attention_layernorm"; Gemma 2/3 add a real one.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, input_pos: Tensor, kv_len: int, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> Tensor:
        h = self.self_attn(self.input_layernorm(x), input_pos, kv_len, cos, sin, mask)
        if not self.sandwich:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_seq_len = 0

    def setup_cache(self, max_seq_len: int, batch: int = 1) -> None:
        """Allocate the KV cache and rope tables once, on the weights' device and dtype."""
        cfg = self.config
        weight = self.model.norm.weight  # embed_tokens.weight may be quantized
        self.max_seq_len = max_seq_len
        with torch.device(weight.device):
            for layer in self.model.layers:
                window = cfg.sliding_window if layer.layer_type is AttentionType.SLIDING else None
                slots = min(window, max_seq_len) if window else max_seq_len
                layer.self_attn.cache = KVCache(
                    batch, cfg.num_key_value_heads, slots, cfg.head_dim, window, weight.dtype
                )
            for name, rope in (("global", cfg.rope_global), ("local", cfg.rope_local)):
                cos, sin = rope_table(rope, cfg.head_dim, max_seq_len)
                self.register_buffer(f"cos_{name}", cos.to(weight.dtype), persistent=False)
                self.register_buffer(f"sin_{name}", sin.to(weight.dtype), persistent=False)

    def forward(
        self, tokens: Tensor, input_pos: Tensor, kv_len: int, all_logits: bool = False
    ) -> Tensor:
        """tokens (B, T) at positions input_pos (T,) -> logits (B, T or 1, vocab).

        Only the last position's logits are computed unless ``all_logits``: a 262k-word vocabulary
        makes full-sequence logits the largest tensor of a prefill.
        """
        return self.logits(self.hidden(tokens, input_pos, kv_len, all_logits))

    def hidden(
        self, tokens: Tensor, input_pos: Tensor, kv_len: int, all_positions: bool = False
    ) -> Tensor:
        """The final normed hidden states (B, T or 1, hidden), written into the cache on the way."""
        cfg = self.config
        embed = self.model.embed_tokens
        quantized = not isinstance(embed, nn.Embedding)  # see quant.py
        x = embed.embed(tokens) if quantized else embed(tokens)  # (B, T, hidden)
        # The sqrt(hidden) scale is rounded to the activation dtype first, as in the reference.
        x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype, device=x.device)
        rope = {
            AttentionType.GLOBAL: (self.cos_global[input_pos], self.sin_global[input_pos]),
            AttentionType.SLIDING: (self.cos_local[input_pos], self.sin_local[input_pos]),
        }
        window = cfg.sliding_window if cfg.has_sliding_layers else None
        masks = attention_masks(input_pos, kv_len, window)
        for layer in self.model.layers:
            cos, sin = rope[layer.layer_type]
            x = layer(x, input_pos, kv_len, cos, sin, masks[layer.layer_type])
        return self.model.norm(x if all_positions else x[:, -1:])

    def logits(self, x: Tensor) -> Tensor:
        """Normed hidden states (B, T, hidden) -> logits (B, T, vocab)."""
        cfg = self.config
        head = self.model.embed_tokens if cfg.tie_word_embeddings else self.lm_head
        if isinstance(head, nn.Embedding):  # tied, float: 63% of Gemma 3 270M's weight bytes
            logits = linear(x, head.weight)  # (B, T, vocab)
        else:  # Linear, or a quantized matrix that picks its own kernel (quant.py)
            logits = head(x)
        if (cap := cfg.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
