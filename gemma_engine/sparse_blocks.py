"""The blocks only Gemma 3n and 4 have: the mixture of experts (Router, Experts) of Gemma 4,
and Gemma 3n's AltUp, LAuReL and gaussian top-k activation sparsity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import GemmaConfig
from .layers import Linear, RMSNorm, batched_linear


def gaussian_top_k(x: Tensor, z: float) -> Tensor:
    """Gemma 3n: zero all but the values above a cutoff fitted as if x (per row) were normal."""
    std = torch.std(x, dim=-1, keepdim=True, unbiased=False)
    cutoff = x.mean(-1, keepdim=True) + std * torch.tensor(z, dtype=x.dtype, device=x.device)
    return F.relu(x - cutoff)


class Router(nn.Module):
    """Gemma 4 MoE: each token's top-k experts and their weights, routed from the residual."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.input_scale = config.hidden_size**-0.5
        self.norm = RMSNorm(config.hidden_size, config, scale=False)
        self.proj = Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, hidden) -> fp32 weights (N, K) and expert ids (N, K)."""
        h = self.norm(x) * self.scale * self.input_scale
        # fp32 probabilities, as the reference: in bf16, near-ties could pick other experts.
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # (N, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, K)
        weights = weights / weights.sum(-1, keepdim=True) * self.per_expert_scale[experts]
        return weights, experts


class Experts(nn.Module):
    """Gemma 4 MoE: GeGLU experts stored as two 3-D tensors, as transformers saves them.

    Decode (a few tokens, the compiled step) gathers each token's k experts and multiplies in
    place: fixed shapes, no host sync. A prompt sorts its (token, expert) pairs by expert and
    runs one dense product per expert, since gathering per token would copy k experts for
    each of up to 512 tokens.
    """

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        width, hidden = config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, hidden, width))

    def matrices(self, experts: Tensor | int) -> tuple[Tensor, Tensor]:
        """(gate_up, down) of ``experts`` (ids of any shape, or one id): the one read of the
        weights, where quantized experts would be expanded."""
        return self.gate_up_proj[experts], self.down_proj[experts]

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """x (N, hidden), weights and experts (N, K) -> the weighted sum of experts (N, hidden)."""
        if x.shape[0] == 1 or torch.compiler.is_compiling():
            gate_up, down = self.matrices(experts)  # (N, K, 2I, hidden), (N, K, hidden, I)
            gate, up = batched_linear(x[:, None, :], gate_up).chunk(2, dim=-1)  # (N, K, I)
            y = batched_linear(F.gelu(gate, approximate="tanh") * up, down)  # (N, K, hidden)
            return (y * weights[..., None]).sum(1).to(x.dtype)
        k = experts.shape[1]
        flat = experts.flatten()  # (N*K,): token-major
        order = flat.argsort(stable=True)
        tokens = order // k  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
        rows = x[tokens]  # (N*K, hidden), grouped by expert
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                gate_up, down = self.matrices(e)
                gate, up = F.linear(rows[start : start + n], gate_up).chunk(2, dim=-1)
                outs.append(F.linear(F.gelu(gate, approximate="tanh") * up, down))
            start += n
        y = torch.cat(outs) * weights.flatten()[order, None]  # (N*K, hidden)
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


class AltUp(nn.Module):
    """Gemma 3n's alternating updates: the hidden state is N streams (N, B, T, hidden).

    A layer runs on one stream (the active one); before it, a learned map of all the streams
    predicts each one, and after it, the layer's change to the active stream corrects them all.
    ``spread`` and ``merge`` make the streams from the embeddings and back, at the model's ends.
    """

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        n, hidden = config.altup_num_inputs, config.hidden_size
        self.n, self.active = n, config.altup_active_idx
        self.correct_scale = config.altup_correct_scale
        self.router_scale = 1.0 / hidden
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = Linear(n, n, bias=False)
        self.prediction_coefs = Linear(n, n * n, bias=False)
        self.modality_router = Linear(hidden, n, bias=False)
        self.router_norm = RMSNorm(hidden, config)

    def _modalities(self, x: Tensor) -> Tensor:
        routed = self.modality_router(self.router_norm(x) * self.router_scale)  # (B, T, N)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: Tensor) -> Tensor:
        modalities = self._modalities(streams[self.active])
        coefs = self.prediction_coefs(modalities).unflatten(-1, (self.n, self.n))
        coefs = coefs.transpose(-1, -2)  # (B, T, N, N)
        mixed = torch.matmul(streams.permute(1, 2, 3, 0), coefs)  # (B, T, hidden, N)
        return (mixed.permute(3, 0, 1, 2) + streams).type_as(streams)  # (N, B, T, hidden)

    def correct(self, predicted: Tensor, out: Tensor) -> Tensor:
        """Streams after a layer turned the active prediction into ``out`` (B, T, hidden)."""
        coefs = self.correction_coefs(self._modalities(out)) + 1.0  # (B, T, N)
        innovation = out - predicted[self.active]  # (B, T, hidden)
        corrected = innovation * coefs.permute(2, 0, 1).unsqueeze(-1) + predicted
        return corrected.type_as(out)  # (N, B, T, hidden)

    def scaled_active(self, streams: Tensor) -> Tensor:
        x = streams[self.active]
        if not self.correct_scale:
            return x
        return (x.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x)

    @staticmethod
    def spread(x: Tensor, projections: nn.ModuleList) -> Tensor:
        """Embeddings (B, T, hidden) -> streams: x, then projections of x at x's RMS."""
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        return torch.stack([x, *(_at_rms(p(x), rms) for p in projections)])

    @staticmethod
    def merge(streams: Tensor, projections: nn.ModuleList) -> Tensor:
        """Streams -> (B, T, hidden): the mean of stream 0 and the others projected back at its
        RMS."""
        rms = streams[0].pow(2).mean(-1, keepdim=True).sqrt()
        back = (_at_rms(p(s), rms) for p, s in zip(projections, streams[1:], strict=True))
        return torch.stack([streams[0], *back]).mean(0)


def _at_rms(x: Tensor, rms: Tensor) -> Tensor:
    """x rescaled to the given root mean square (its own clamped away from zero)."""
    return x * rms / x.pow(2).mean(-1, keepdim=True).clamp(min=1e-5).sqrt()


class Laurel(nn.Module):
    """Gemma 3n's LAuReL: a learned low-rank residual of the normed input, beside attention."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.linear_left = Linear(config.hidden_size, config.laurel_rank, bias=False)
        self.linear_right = Linear(config.laurel_rank, config.hidden_size, bias=False)
        self.post_laurel_norm = RMSNorm(config.hidden_size, config)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))
