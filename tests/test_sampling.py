"""sampling.greedy against torch's argmax: the same index for every row, ties and NaN included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemma_engine import sampling

VOCABS = [262_144, 256_000, 4096, 512, 1000]  # Gemma 3, Gemma 1/2, blocked and unblocked sizes


@settings(max_examples=200, deadline=None, database=None)
@given(
    vocab=st.sampled_from(VOCABS),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    ties=st.integers(0, 3),
    special=st.sampled_from(["none", "nan", "-inf row", "+inf", "low values"]),
)
def test_greedy_is_argmax(vocab, rows, seed, ties, special):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 10
    top = logits.max() + 1
    for _ in range(ties):  # equal maxima: the first one wins
        at = torch.randint(0, vocab, (rows,), generator=g)
        logits[torch.arange(rows), at] = top
    row = int(torch.randint(0, rows, (1,), generator=g))
    at = int(torch.randint(0, vocab, (1,), generator=g))
    if special == "nan":
        logits[row, at] = float("nan")
    elif special == "-inf row":
        logits[row] = float("-inf")
    elif special == "+inf":
        logits[row, at] = float("inf")
    elif special == "low values":
        logits[row] = -3e38
    assert torch.equal(sampling.greedy(logits), logits.argmax(-1))


@pytest.mark.parametrize("shape", [(262_144,), (2, 3, 262_144), (1, 262_144)])
def test_greedy_keeps_the_leading_shape(shape):
    logits = torch.randn(shape)
    got = sampling.greedy(logits)
    assert got.shape == shape[:-1] and torch.equal(got, logits.argmax(-1))


def test_greedy_reads_a_strided_view():
    logits = torch.randn(3, 4, 262_144)[:, -1]  # the last position's logits, not contiguous
    assert torch.equal(sampling.greedy(logits), logits.argmax(-1))
