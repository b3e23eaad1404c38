"""Greedy steps through the output layer's int8 copy (greedy_screen.py) pick the same tokens as
the full float logits: against float64 products, and against the same engine without it."""

from __future__ import annotations

import pytest
import torch

from gemma_engine import Engine, InvalidRequestError, loading, quant
from gemma_engine.greedy_screen import GreedyScreen

BUCKETS = [32, 64]


def screened_tokens(weight: torch.Tensor, hidden: torch.Tensor, softcap: float | None = None):
    """(the screen's tokens, how many rows passed per hidden state) for hidden (B, 1, K)."""
    screen = GreedyScreen(*quant.quantize_int8(weight))
    out = screen(hidden)
    high, floor = out[:, weight.shape[1] : -1], out[:, -1:]
    return screen.pick(out, weight, softcap), (high >= floor).sum(-1)


def test_the_screen_picks_the_argmax_of_the_float_logits():
    gen = torch.Generator().manual_seed(0)
    vocab, width = 4096, 64
    weight = torch.randn(vocab, width, generator=gen) * torch.rand(vocab, 1, generator=gen)
    weight[3000] = weight[100] * 1.5  # rows of one direction and scale: exact ties below
    weight[200] = weight[3000]
    # Peaked and flat hidden states, one with a few large features (as Gemma's have).
    hidden = torch.randn(64, 1, width, generator=gen) * torch.rand(64, 1, 1, generator=gen) * 8
    hidden[5, 0, :3] *= 200
    hidden[6, 0] = weight[3000] * 4  # its best rows are 200 and 3000, tied: 200 wins
    tokens, passed = screened_tokens(weight, hidden)
    logits = hidden[:, 0].double() @ weight.double().T
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[6] == 200
    # The screen does its work: few rows need their float logits.
    assert passed.max() < vocab // 20, passed
    # Capped logits (Gemma 2), as the model caps them in float32: a cap far above the logits
    # (the screen decides), and one they saturate (many exact ties at the cap: the lowest id).
    logits = hidden[:, 0] @ weight.T
    for softcap in (500.0, 3.0):
        tokens, _ = screened_tokens(weight, hidden, softcap)
        capped = torch.tanh(logits / softcap) * softcap
        assert tokens.tolist() == capped.argmax(-1).tolist()
    assert (capped == 3.0).sum() > 64  # the saturated case was reached


def test_a_hidden_state_without_finite_bounds_gets_its_full_logits():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(512, 32, generator=gen)
    hidden = torch.randn(3, 1, 32, generator=gen)
    hidden[1, 0, 7] = float("nan")
    hidden[2, 0, 3] = float("inf")
    tokens, passed = screened_tokens(weight, hidden)
    assert passed[1:].tolist() == [0, 0]  # no candidates: the full logits decide
    assert tokens.tolist() == (hidden[:, 0] @ weight.T).argmax(-1).tolist()


def test_screened_greedy_decode_equals_plain_greedy(tiny_checkpoints):
    # Gemma 2: a final softcap and a sliding window of 8. The reference is the eager engine,
    # which reads every logit (compiled graphs without the screen are test_decode's).
    folder = tiny_checkpoints["gemma2"][0]
    plain = Engine.from_pretrained(folder, compile=False, max_seq_len=64, max_batch=1)
    screened = Engine.from_pretrained(
        folder, compile=True, max_seq_len=64, buckets=BUCKETS, max_batch=1, greedy_screen=True
    )
    assert screened.screens and not plain.screens
    plain.eos_token_ids = screened.eos_token_ids = set()  # every sequence runs its length
    prompts = [[2, 17, 40, 99, 5], [2, 300, 7]]
    for ids in prompts:  # 50 new tokens cross both buckets and wrap the window of 8
        want = plain.generate(ids, max_new_tokens=50)
        got = screened.generate(ids, max_new_tokens=50)
        assert got.token_ids == want.token_ids
    assert sorted(screened.compile_seconds) == [(1, kv, "screened") for kv in BUCKETS]
    assert got.stats["buckets_used"] == BUCKETS
    # Sampled requests and logprobs need every logit: the plain graph.
    sampled = screened.generate(prompts[0], max_new_tokens=4, temperature=1.0, seed=3)
    assert sampled.stats["graphs_compiled"] == [(1, 32)]
    with_logprobs = screened.generate(prompts[0], max_new_tokens=4, logprobs=0)
    assert with_logprobs.token_ids == plain.generate(prompts[0], max_new_tokens=4).token_ids
    assert len(with_logprobs.logprobs) == 4


def test_a_batch_of_greedy_requests(tiny_checkpoints):
    folder = tiny_checkpoints["gemma3"][0]
    plain = Engine.from_pretrained(folder, compile=False, max_seq_len=64, max_batch=2)
    screened = Engine.from_pretrained(
        folder, compile=True, max_seq_len=64, buckets=[64], max_batch=2, greedy_screen=True
    )
    plain.eos_token_ids = screened.eos_token_ids = set()
    prompts = [[2, 17, 40, 99, 5], [2, 300, 7, 8, 9]]

    def run(engine: Engine) -> list[list[int]]:
        handles = [engine.submit(p, max_new_tokens=30) for p in prompts]
        return [h.result().token_ids for h in handles]

    assert run(screened) == run(plain)
    assert (2, 64, "screened") in screened.compile_seconds  # the two rows stepped together


def test_the_int8_copy_is_kept_for_the_next_process(tiny_checkpoints, monkeypatch):
    folder = tiny_checkpoints["gemma3"][0]
    first = Engine.from_pretrained(folder, compile=True, max_seq_len=64, greedy_screen=True)

    def refuse(*args, **kwargs):
        raise AssertionError("quantized again instead of read from the cache")

    monkeypatch.setattr(quant, "quantize_int8", refuse)
    again = Engine.from_pretrained(folder, compile=True, max_seq_len=64, greedy_screen=True)
    assert torch.equal(again.model.greedy_screen.blocks, first.model.greedy_screen.blocks)
    assert torch.equal(again.model.greedy_screen.scale, first.model.greedy_screen.scale)
    assert "greedy_screen" not in " ".join(again.model.state_dict())  # never saved


def test_the_screen_is_refused_where_it_cannot_run(tiny_checkpoints, monkeypatch):
    folder = tiny_checkpoints["gemma3"][0]

    def placed(*args, **kwargs):
        raise AssertionError("the weights were placed before the request was checked")

    with monkeypatch.context() as patch:  # each refused before any weight is placed
        patch.setattr(loading, "build_model", placed)
        with pytest.raises(InvalidRequestError, match="compiled decode graphs"):
            Engine.from_pretrained(folder, compile=False, greedy_screen=True)
        with pytest.raises(InvalidRequestError, match="float32 output layer"):
            Engine.from_pretrained(folder, compile=True, quantize="int8", greedy_screen=True)
        with pytest.raises(InvalidRequestError, match="float32 output layer"):
            Engine.from_pretrained(folder, compile=True, dtype="bfloat16", greedy_screen=True)
    # By default a tiny output layer goes without: it is read fast enough as it is.
    assert not Engine.from_pretrained(folder, compile=True, max_seq_len=64).screens
