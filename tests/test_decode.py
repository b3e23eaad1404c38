"""The bucketed KV cache: incremental decode equals one full forward, one graph per bucket."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from gemma_engine import Engine, InvalidRequestError
from gemma_engine.engine import default_buckets

BUCKETS = [8, 16, 32, 64]  # 40 positions cross three bucket boundaries


def ids_for(n: int, seed: int = 0) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def incremental_logits(engine: Engine, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Prefill ``prompt_len`` tokens, then decode the rest one step at a time, in the cache row
    the prefill went to (the most recently acquired slot)."""
    out = [engine.score(ids[:prompt_len])]
    row = max(engine.scheduler.slots.slots, key=lambda s: s.last_used).index
    for pos in range(prompt_len, len(ids)):
        tokens, input_pos = torch.tensor([[ids[pos]]]), torch.tensor([pos])
        logits = engine.step(tokens, input_pos, engine.bucket_for(pos + 1), torch.tensor([row]))
        out.append(logits[0].float())
    return torch.cat(out)


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "compiled"])
def compile_mode(request) -> bool:
    return request.param


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_incremental_equals_full_forward(kind, compile_mode, tiny_checkpoints):
    folder = tiny_checkpoints[kind][0]
    torch._dynamo.reset()  # same-shaped models share graphs: start from none to count them
    engine = Engine.from_pretrained(folder, compile=compile_mode, max_seq_len=64, buckets=BUCKETS)
    ids = ids_for(40)
    full = engine.score(ids)
    graphs = counters["stats"]["unique_graphs"]
    got = incremental_logits(engine, ids, prompt_len=5)
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)
    if compile_mode:  # positions 5..39 touch buckets 8, 16, 32 and 64: four graphs, no more
        # At most four traced: none when a graph was found saved whole (saved_graphs.py).
        assert counters["stats"]["unique_graphs"] - graphs <= 4
        assert sorted(engine.compile_seconds) == [(1, b) for b in BUCKETS]
    # A second, shorter sequence reuses the cache without clearing it: stale slots are masked.
    other = ids_for(20, seed=1)
    graphs = counters["stats"]["unique_graphs"]
    torch.testing.assert_close(
        incremental_logits(engine, other, 3), engine.score(other), atol=1e-4, rtol=0
    )
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation inside a bucket


@pytest.mark.parametrize("cap", [None, 5.0])
def test_one_query_attention_matches_softmax_attention(cap):
    """The compiled decode step's attention (fused reductions) against attention computed
    directly in float64: grouped heads, a masked tail, two rows, Gemma 2's soft-cap."""
    from gemma_engine.layers import one_query_attention

    gen = torch.Generator().manual_seed(0)
    B, KV, G, S, D = 2, 2, 3, 40, 16
    q, keys, values = (torch.randn(B, KV, n, D, generator=gen) for n in (G, S, S))
    visible = torch.ones(B, 1, 1, S, dtype=torch.bool)
    visible[0, ..., 29:] = False  # row 0 sees 29 keys, row 1 all of them
    scores = torch.einsum("bkgd,bksd->bkgs", q.double(), keys.double()) * 0.25
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    expected = torch.einsum("bkgs,bksd->bkgd", probs, values.double())
    compiled = torch.compile(one_query_attention, fullgraph=True, dynamic=False)
    out = compiled(q, keys, values, visible, 0.25, cap)
    assert out.shape == (B, KV, G, D)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_generation_compiles_one_graph_per_bucket(tiny_checkpoints):
    folder = tiny_checkpoints["gemma3"][0]
    torch._dynamo.reset()
    compiled = Engine.from_pretrained(folder, compile=True, max_seq_len=64, buckets=BUCKETS)
    eager = Engine.from_pretrained(folder, compile=False, max_seq_len=64, buckets=BUCKETS)
    prompt = ids_for(6, seed=3)
    notices: list[str] = []
    compiled.on_compile = notices.append  # what gemma-run prints on stderr
    first = compiled.generate(prompt, max_new_tokens=30)  # positions 6..35: buckets 8..64
    assert first.stats["buckets_compiled"] == first.stats["buckets_used"] == [8, 16, 32, 64]
    # Each new graph is announced before it compiles (exactly when it compiles: a graph saved
    # by an earlier run of this test is loaded, not compiled) and again, with its time and
    # where it came from, once ready.
    ready = [n for n in notices if " is ready (" in n]
    loaded = [n.endswith(", from the compile cache)") for n in ready]
    assert [n.split(" (")[0] for n in notices if "decode graph" in n] == [
        line
        for kv, was_loaded in zip((8, 16, 32, 64), loaded, strict=True)
        for line in (
            *([] if was_loaded else [f"compiling the decode graph for 1 row and kv bucket {kv}"]),
            f"the decode graph for 1 row and kv bucket {kv} is ready",
        )
    ]
    # One graph per bucket (saved whole or, where that is not possible, dynamo's own).
    assert sorted(compiled.compile_seconds) == [(1, kv) for kv in (8, 16, 32, 64)]
    assert first.token_ids == eager.generate(prompt, max_new_tokens=30).token_ids
    notices.clear()
    graphs = counters["stats"]["unique_graphs"]
    again = compiled.generate(ids_for(4, seed=4), max_new_tokens=30)
    assert again.stats["buckets_compiled"] == [] and not [n for n in notices if "decode" in n]
    assert counters["stats"]["unique_graphs"] == graphs  # no graph traced again
    # A graph checks dynamo's guards on its first call only: the step checks its arguments.
    for name, wrong in (("tokens", torch.int32), ("input_pos", torch.int32), ("rows", torch.int)):
        args = dict(tokens=torch.tensor([[5]]), input_pos=torch.tensor([9]), rows=torch.tensor([0]))
        args[name] = args[name].to(wrong)
        with pytest.raises(TypeError, match=f"Engine.step: {name} must be an int64 tensor"):
            compiled.step(args["tokens"], args["input_pos"], 16, args["rows"])


@pytest.fixture(scope="module")
def engine(tiny_checkpoints) -> Engine:
    return Engine.from_pretrained(
        tiny_checkpoints["gemma3"][0], compile=False, max_seq_len=64, buckets=BUCKETS
    )


def test_sampling_is_reproducible_with_a_seed(engine):
    kwargs = dict(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9)
    a = engine.generate(ids_for(5), seed=7, **kwargs)
    b = engine.generate(ids_for(5), seed=7, **kwargs)
    c = engine.generate(ids_for(5), seed=8, **kwargs)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(ids_for(5), max_new_tokens=20)
    sampled = engine.generate(ids_for(5), max_new_tokens=20, temperature=0.7, top_k=1, seed=1)
    assert sampled.token_ids == greedy.token_ids


def test_top_p_keeps_only_the_nucleus():
    from gemma_engine.sampling import SamplingParams, sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.7)
    gen = torch.Generator().manual_seed(0)
    drawn = {sample(logits, params, gen).item() for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token():
    """top_p = 1e-300 rounds to 0 in float32: the first token must stay all the same (it was
    dropped with the rest, and sampling failed on an all-NaN distribution)."""
    from gemma_engine.sampling import SamplingParams, probabilities

    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-300))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_a_step_that_fails_after_the_prompt_fails_its_request(engine, monkeypatch):
    """An error while sampling the first token fails that request (it is not left waiting with
    its cache row taken), and the engine goes on."""
    import gemma_engine.scheduler as scheduler

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    with monkeypatch.context() as patch:
        patch.setattr(scheduler, "sample_rows", broken)
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.generate(ids_for(5), max_new_tokens=3)
    assert not any(slot.busy for slot in engine.scheduler.slots.slots)
    assert len(engine.generate(ids_for(5), max_new_tokens=3).token_ids) == 3


def test_stream_equals_generate_and_length_limits(engine):
    prompt = ids_for(5)
    full = engine.generate(prompt, max_new_tokens=25)
    assert "".join(engine.stream(prompt, max_new_tokens=25)) == full.text
    assert full.text == engine.tokenizer.decode(full.token_ids)
    assert full.finish_reason == "length" and len(full.token_ids) == 25
    # A nearly full cache: one token per free slot, plus the one sampled from the last step.
    capped = engine.generate(ids_for(60), max_new_tokens=50)
    assert len(capped.token_ids) == 5 and capped.finish_reason == "length"


def test_stop_string_ends_the_text(engine):
    full = engine.generate(ids_for(5), max_new_tokens=25)
    assert len(full.text) > 6, "the tiny model should produce some text"
    stop = full.text[3:6]
    cut = engine.generate(ids_for(5), max_new_tokens=25, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert "".join(engine.stream(ids_for(5), max_new_tokens=25, stop=stop)) == cut.text


def test_batch_of_prompts(engine):
    results = engine.generate(["abc", "def"], max_new_tokens=5)
    assert [r.text for r in results] == [
        engine.generate(p, max_new_tokens=5).text for p in ("abc", "def")
    ]


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-3), "seed"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_values(engine, kwargs, word):
    with pytest.raises(InvalidRequestError, match=word):
        engine.generate("hello", **kwargs)


def test_prompt_longer_than_cache(engine):
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        engine.generate(ids_for(65), max_new_tokens=1)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.generate([5, 10_000], max_new_tokens=1)


def test_default_buckets_double_up_to_the_cache():
    assert default_buckets(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert default_buckets(3000) == [256, 512, 1024, 2048, 3000]
    assert default_buckets(100) == [100]


@pytest.mark.parametrize("library", [True, False], ids=["blas-gemv", "fused-reduce"])
def test_tied_output_layer_for_one_token(library, monkeypatch, tiny_checkpoints):
    """The tied output layer's product for one token in a compiled step, through each of the
    two kernels cpu.LIBRARY_GEMV_FOR_OUTPUT picks between by CPU vendor (so that the one this
    machine does not take is checked here too), against the eager product."""
    from gemma_engine import cpu

    engine = Engine.from_pretrained(tiny_checkpoints["gemma3"][0], compile=False)
    model = engine.model
    assert model.config.tie_word_embeddings
    monkeypatch.setattr(cpu, "LIBRARY_GEMV_FOR_OUTPUT", library)
    torch._dynamo.reset()
    x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = torch.compile(model.logits, fullgraph=True, dynamic=False)(x)
        expected = torch.nn.functional.linear(x.double(), model.output_layer().weight.double())
    assert got.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
