"""Token sampling: a pure function of the logits, outside the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InvalidRequestError
from .inputs import MAX_SEED, MIN_TEMPERATURE, real_number, whole_number


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        # Normalized in place (a numpy int seed becomes an int); bools and NaN are refused.
        t = real_number(self.temperature, "temperature")
        if t < 0 or 0 < t < MIN_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE} up, got {t!r}"
            )
        object.__setattr__(self, "temperature", t)
        if self.top_k is not None:
            object.__setattr__(self, "top_k", whole_number(self.top_k, "top_k", 1))
        if self.top_p is not None:
            p = real_number(self.top_p, "top_p")
            if not 0 < p <= 1:
                raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
            object.__setattr__(self, "top_p", p)
        if self.seed is not None:
            object.__setattr__(self, "seed", whole_number(self.seed, "seed", 0, MAX_SEED))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_BLOCK = 512  # logits per block in greedy()'s first pass


def greedy(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` for logits (..., vocab), in two passes over blocks of the vocabulary.

    torch's argmax along one long row runs as a scalar loop on one thread: 0.39 ms for Gemma 3's
    262,144 logits on the project's 2-core VM, ~2.5% of an int8 decode step. The blocks' maxima
    (a vectorized amax, 0.02 ms), then the argmax of the best block's first maximum, find the same
    index (the first maximum; a NaN counts as the maximum, as in argmax) in 0.04 ms.
    """
    vocab = logits.shape[-1]
    if vocab % _BLOCK or vocab < 8 * _BLOCK:
        return logits.argmax(dim=-1)
    rows = logits.reshape(-1, vocab // _BLOCK, _BLOCK)
    block = rows.amax(dim=-1).argmax(dim=-1)  # (R,): the first block holding the maximum
    within = rows[torch.arange(rows.shape[0], device=rows.device), block].argmax(dim=-1)
    return (block * _BLOCK + within).reshape(logits.shape[:-1])


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """Next token ids (B,) from last-position logits (B, vocab); stays on the logits' device."""
    if params.greedy:
        return greedy(logits)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution ``sample`` draws from (B, vocab), float32: temperature, then top-k and
    top-p; speculative decoding (speculative.py) accepts and rejects drafts against it."""
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays
        # (set explicitly: a top_p below float32's range rounds to 0, and 0 >= 0 would drop it).
        drop = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(dim=-1)


def sample_rows(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> Tensor:
    """Next token ids (B,) for a batch whose rows each have their own sampling parameters.

    Greedy rows come from one argmax over the batch; a sampled row is drawn alone, with its own
    generator, so a seeded request gets the same tokens whatever it is batched with.
    """
    tokens = greedy(logits)  # (B,)
    for i, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if not row_params.greedy:
            tokens[i] = sample(logits[i : i + 1], row_params, generator)[0]
    return tokens


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first


def token_logprobs(logits: Tensor, tokens: Tensor, tops: list[int]) -> list[TokenLogprob]:
    """Each row's chosen token (B,) with its log-probability under logits (B, vocab), and the
    ``tops[i]`` most likely tokens of row i. The distribution is the model's own (log-softmax
    of the logits, before temperature, top-k and top-p), as vLLM reports by default, so it is
    the same whatever the sampling settings (and equals a scoring pass, ``Engine.score``)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, vocab)
    chosen = logprobs.gather(-1, tokens.view(-1, 1))[:, 0].tolist()
    k = max(tops, default=0)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    values, ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(
            int(t), chosen[i], list(zip(ids[i][: tops[i]], values[i][: tops[i]], strict=True))
        )
        for i, t in enumerate(tokens.tolist())
    ]
