"""Token sampling: a pure function of the logits, outside the model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise InvalidRequestError(f"top_k must be a whole number >= 1, got {self.top_k!r}")
        p = self.top_p
        if p is not None and (not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be a whole number >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """Next token ids (B,) from last-position logits (B, vocab); stays on the logits' device."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> Tensor:
    """Next token ids (B,) for a batch whose rows each have their own sampling parameters.

    Greedy rows come from one argmax over the batch; a sampled row is drawn alone, with its own
    generator, so a seeded request gets the same tokens whatever it is batched with.
    """
    tokens = logits.argmax(dim=-1)  # (B,)
    for i, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if not row_params.greedy:
            tokens[i] = sample(logits[i : i + 1], row_params, generator)[0]
    return tokens
