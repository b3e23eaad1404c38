"""A KV cache kept in a narrower dtype than the model computes in (``kv_cache_dtype``).

The reference is transformers on the same weights with a cache that rounds every key and value
it stores to that dtype (and hands them back widened), which is what the engine's cache does:
the two must then agree as closely as the float32 engines do (test_parity.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from gemma_engine import Engine
from gemma_engine.errors import InvalidRequestError
from gemma_engine.model import stored

HALVES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class RoundingCache(DynamicCache):
    """transformers' cache, keeping keys and values rounded to ``dtype``."""

    def __init__(self, config, dtype: str) -> None:
        super().__init__(config=config)
        self.rounding = HALVES[dtype]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def rounded(t):
            return stored(t, self.rounding).to(t.dtype)

        return super().update(
            rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs
        )


@pytest.mark.parametrize("kv", HALVES)
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_a_narrower_cache_matches_transformers_rounding_the_same(kind, kv, tiny_checkpoints):
    """Scores over prompts that wrap the sliding ring, in chunks that read it first
    (model.reads_first) and ones that write first, and greedy decoding on from them.

    The engine's keys differ from transformers' in their last float32 bits, so a few round to
    the neighbouring half-precision value: the scores agree to a fraction of what rounding
    the cache changes (at most 16% here; with float32 caches they agree to 5e-6)."""
    folder, reference = tiny_checkpoints[kind]
    engine = Engine.from_pretrained(
        folder, compile=False, max_seq_len=128, prefill_chunk=36, kv_cache_dtype=kv
    )
    assert engine.kv_cache_dtype == HALVES[kv]
    for seed, length in [(0, 7), (1, 40), (2, 120)]:
        ids = random_ids(length, seed)
        with torch.no_grad():
            rounded = reference(torch.tensor([ids]), cache=RoundingCache(reference.config, kv))
            full = reference(torch.tensor([ids])).logits[0]
        expected = rounded.logits[0]
        got = engine.score(ids)
        assert got.shape == expected.shape
        assert (got - expected).abs().max() <= 0.3 * (expected - full).abs().max()
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)
    prompt = random_ids(60, seed=3)
    want = reference.generate(
        torch.tensor([prompt]),
        cache=RoundingCache(reference.config, kv),
        max_new_tokens=30,
        min_new_tokens=30,
        do_sample=False,
    )[0, 60:].tolist()
    got = engine.generate(prompt, max_new_tokens=30).token_ids
    assert got == want[: len(got)] and len(got) >= 20


def test_a_float16_cache_holds_half_the_bytes_and_keeps_outliers_finite(tiny_checkpoints):
    folder, _ = tiny_checkpoints["gemma3"]
    full = Engine.from_pretrained(folder, compile=False, max_seq_len=128)
    half = Engine.from_pretrained(folder, compile=False, max_seq_len=128, kv_cache_dtype="fp16")
    assert full.kv_cache_dtype == torch.float32 and half.kv_cache_dtype == torch.float16
    assert half.kv_cache_bytes * 2 == full.kv_cache_bytes
    big = torch.tensor([1e6, -1e6, 1.0, float("nan")])
    out = stored(big, torch.float16)
    assert out[:3].tolist() == [65504.0, -65504.0, 1.0] and out[3].isnan()


def test_compiled_decode_with_a_float16_cache_equals_eager(tiny_checkpoints):
    """The compiled step reads the float16 cache inside its fused reductions
    (layers.one_query_attention); eagerly the keys are widened for the library's products."""
    folder, _ = tiny_checkpoints["gemma3"]
    options = dict(max_seq_len=32, buckets=[32], max_batch=1, kv_cache_dtype="float16")
    eager = Engine.from_pretrained(folder, compile=False, **options)
    compiled = Engine.from_pretrained(folder, compile=True, **options)
    for seed in range(2):
        prompt = random_ids(9, seed)
        want = eager.generate(prompt, max_new_tokens=20)
        got = compiled.generate(prompt, max_new_tokens=20)
        assert got.token_ids == want.token_ids
    assert [key[:2] for key in compiled.compile_seconds] == [(1, 32)]  # one graph, kept


def test_a_kv_cache_dtype_that_is_not_a_float_is_refused(tiny_checkpoints):
    folder, _ = tiny_checkpoints["gemma3"]
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype 'int8' is not one of"):
        Engine.from_pretrained(folder, compile=False, kv_cache_dtype="int8")
