"""Speculative decoding (speculative.py): the same tokens as plain decode, the same distribution.

The tiny models have a window of 8; with a prompt chunk of 6 their rings hold 14 entries, and
64-position sequences in buckets 16, 32 and 64 cross two bucket boundaries and wrap the ring
several times. Prompts that repeat a random run make lookup find drafts.
"""

from __future__ import annotations

import pytest
import torch

from gemma_engine import Engine, cli, cpu, packed_int8, quant
from gemma_engine.draft_vocabulary import DraftVocabulary, base_ids, latin
from gemma_engine.errors import InvalidRequestError
from gemma_engine.sampling import SamplingParams, probabilities
from gemma_engine.speculative import NgramIndex, Speculator, accept_drafts, accept_greedy
from gemma_engine.tokenizer import Tokenizer

BUCKETS = [16, 32, 64]
CHUNK = 6
K = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models on one thread: their steps are too small to split, and on a machine
    shared with other work two OpenMP threads each waiting for the other made a 3-token
    generate take 1.1 s instead of 0.03 s here. (Both sides of every comparison run alike.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(folder, speculate=None, compile=False, **kwargs) -> Engine:
    kwargs = {"max_seq_len": 64, "buckets": BUCKETS, "prefill_chunk": CHUNK, **kwargs}
    tokens = K if speculate else None
    return Engine.from_pretrained(
        folder, compile=compile, speculate=speculate, speculate_tokens=tokens, **kwargs
    )


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


REPEATING = random_ids(5, seed=1) * 3 + random_ids(3, seed=2)  # 18 tokens, a run seen 3 times
NOVEL = random_ids(11, seed=3)


def with_draft_words(engine: Engine, words: int | None) -> Engine:
    """The engine with an int8 drafter whose output layer holds ``words`` common ids and the
    context's tokens (draft_vocabulary.py): fewer than the tiny vocabulary's 512."""
    engine.speculator = Speculator(engine, "int8", K, draft_words=words)
    return engine


def plain_and_speculative(engine: Engine, prompt: list[int], **kwargs):
    """The same engine's output without and with its speculator (the same graphs)."""
    speculator, engine.speculator = engine.speculator, None
    try:
        plain = engine.generate(prompt, **kwargs)
    finally:
        engine.speculator = speculator
    engine.clear_cache()
    return plain, engine.generate(prompt, **kwargs)


# -- arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(speculate="ngram"), "speculate must be one of"),
        (dict(speculate="lookup", speculate_tokens=0), "speculate_tokens must be"),
        (dict(speculate="lookup", speculate_tokens=2.0), "whole number"),
        (dict(speculate_tokens=3), "without speculate"),
        (dict(speculate="lookup", speculate_tokens=6), "prefill_chunk"),  # 6 + 1 > chunk 6
    ],
)
def test_bad_arguments(tiny_checkpoints, kwargs, words):
    with pytest.raises(InvalidRequestError, match=words):
        Engine.from_pretrained(
            tiny_checkpoints["gemma3"][0],
            compile=False,
            max_seq_len=64,
            prefill_chunk=CHUNK,
            **kwargs,
        )


def test_int8_draft_needs_a_float_model(tiny_checkpoints):
    with pytest.raises(InvalidRequestError, match="already int8; use speculate='lookup'"):
        load(tiny_checkpoints["gemma3"][0], "int8", quantize="int8")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--speculate-tokens", "3"], "--speculate-tokens needs --speculate"),
        (["--speculate", "draft"], "invalid choice: 'draft'"),
        (["--speculate", "lookup", "--speculate-tokens", "99"], "speculate_tokens must be"),
    ],
)
def test_cli_reports_bad_speculation_in_one_line(tiny_checkpoints, argv, words, capsys):
    model = ["--model", str(tiny_checkpoints["gemma3"][0]), "--no-compile"]
    try:
        code = cli.main(["--prompt", "hi", *model, *argv])
    except SystemExit as exit:  # argparse's own checks
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("gemma-run: error: "), err
    assert words in err, err


def test_cli_speculates_with_the_same_text(tiny_checkpoints, capsys):
    model = ["--model", str(tiny_checkpoints["gemma3"][0]), "--no-compile", "--max-seq-len", "64"]
    argv = ["--prompt", "The quick brown fox. " * 4, *model, "--max-new-tokens", "24"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr()
    assert cli.main([*argv, "--speculate", "lookup", "--speculate-tokens", "3"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out
    assert "drafts kept" in spec.err and "drafts kept" not in plain.err


# -- drafting ---------------------------------------------------------------------------------
def test_lookup_drafts_what_followed_the_longest_latest_match():
    index = NgramIndex()
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert index.draft(3) == [7, 8, 5]  # "2 3" last seen before the end at 5..6
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3, 9])
    assert index.draft(4) == [1, 2, 3, 7]  # "2 3 9" at 1..3 beats "3 9" and "9"
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3, 9, 42])
    assert index.draft(4) == []  # 42 never appeared before
    assert NgramIndex().draft(4) == []


def test_accept_greedy_stops_at_the_first_difference():
    logits = torch.eye(6)[[3, 4, 0, 5]]  # argmax 3, 4, 0, 5
    assert accept_greedy(logits, [3, 4, 1]) == [3, 4, 0]
    assert accept_greedy(logits, [3, 4, 0]) == [3, 4, 0, 5]  # all kept, plus one
    assert accept_greedy(logits[:2], [2]) == [3]


# -- greedy: token-identical ------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lookup", "int8"])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_greedy_equals_plain_eager(kind, method, tiny_checkpoints):
    """18 + 40 tokens: buckets 16 -> 32 -> 64, the 14-entry rings wrap four times."""
    engine = load(tiny_checkpoints[kind][0], method)
    for prompt in (REPEATING, NOVEL):
        plain, spec = plain_and_speculative(engine, prompt, max_new_tokens=40)
        assert spec.token_ids == plain.token_ids
        assert len(spec.token_ids) == 40
        assert spec.stats["accepted_tokens"] <= spec.stats["drafted_tokens"]
        assert spec.stats["buckets_used"] == plain.stats["buckets_used"]
    # The repeating prompt's run is drafted and kept (the tiny models loop, too).
    assert spec.stats["drafted_tokens"] > 0 and spec.stats["accepted_tokens"] > 0
    assert plain.stats["drafted_tokens"] == 0


def test_a_partial_draft_vocabulary_keeps_greedy_exact(tiny_checkpoints):
    """The int8 drafter over 64 common ids and the context's tokens, eager, across buckets and
    the ring: the same tokens as plain, and every draft one of the head's tokens."""
    engine = with_draft_words(load(tiny_checkpoints["gemma3"][0], "int8"), 64)
    vocab = engine.speculator.drafter.vocab
    assert vocab.rows < engine.config.vocab_size
    for prompt in (REPEATING, NOVEL):
        plain, spec = plain_and_speculative(engine, prompt, max_new_tokens=40)
        assert spec.token_ids == plain.token_ids
        assert spec.stats["drafted_tokens"] > 0 and spec.stats["accepted_tokens"] > 0
        assert set(prompt + plain.token_ids[:-1]) <= set(vocab.held)


def test_int8_weights_with_lookup_equal_plain(tiny_checkpoints):
    """An int8 model verifies through its own quantized kernels (eager: expanded weights)."""
    engine = load(tiny_checkpoints["gemma3"][0], "lookup", quantize="int8")
    plain, spec = plain_and_speculative(engine, REPEATING, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.stats["accepted_tokens"] > 0


def test_verify_rows_equal_plain_steps(tiny_checkpoints):
    """k + 1 positions of one sequence as k + 1 rows of one step, against k + 1 one-row steps
    (eager: MKL's GEMM against its GEMV, rounding only; see speculative.py)."""
    engine = load(tiny_checkpoints["gemma3"][0])
    ids = random_ids(40, seed=5)
    p = 13  # the rows cross the bucket boundary at 16

    def prefill():
        for s in range(0, p, CHUNK):
            engine.prefill(ids[s : min(s + CHUNK, p)], s, 0, False)

    with torch.no_grad():
        prefill()
        plain = torch.stack(
            [
                engine.step(
                    torch.tensor([[ids[p + i]]]),
                    torch.tensor([p + i]),
                    engine.bucket_for(p + i + 1),
                )[0, -1]
                for i in range(K + 1)
            ]
        )
        prefill()
        rows = engine.step(
            torch.tensor(ids[p : p + K + 1])[:, None],
            torch.arange(p, p + K + 1),
            engine.bucket_for(p + K + 1),
            torch.zeros(K + 1, dtype=torch.long),
        )[:, -1]
    torch.testing.assert_close(rows, plain, atol=1e-5, rtol=0)
    assert torch.equal(rows.argmax(-1), plain.argmax(-1))


def test_other_requests_decode_plainly_and_identically(tiny_checkpoints):
    """Two requests at once take plain batched steps; the one left speculates."""
    engine = load(tiny_checkpoints["gemma3"][0], "lookup", max_batch=2)
    prompts = [REPEATING, NOVEL]
    speculator, engine.speculator = engine.speculator, None
    alone = []
    for prompt, n in zip(prompts, (40, 12), strict=True):
        engine.clear_cache()
        alone.append(engine.generate(prompt, max_new_tokens=n).token_ids)
    engine.speculator = speculator
    engine.clear_cache()
    requests = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, (40, 12), strict=True)]
    results = [r.result() for r in requests]
    assert [r.token_ids for r in results] == alone
    assert results[0].stats["accepted_tokens"] > 0


def test_logprobs_and_stop_strings_with_speculation(tiny_checkpoints):
    engine = load(tiny_checkpoints["gemma3"][0], "lookup")
    plain, spec = plain_and_speculative(engine, REPEATING, max_new_tokens=30, logprobs=2)
    assert spec.token_ids == plain.token_ids
    assert [e.token for e in spec.logprobs] == spec.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    stop = engine.tokenizer.decode(plain.token_ids[10:12])
    if stop.strip():
        plain, spec = plain_and_speculative(engine, REPEATING, max_new_tokens=30, stop=stop)
        assert (spec.text, spec.finish_reason) == (plain.text, plain.finish_reason)


def test_compiled_greedy_equals_plain(tiny_checkpoints):
    """Compiled, one kv bucket (64: the eager tests cross buckets; each graph costs tens of
    seconds to build here): the plain one-row graph, the k + 1-row verify graph and the int8
    draft's graph, each built once; both drafters token-identical to plain."""
    torch._dynamo.reset()
    engine = load(tiny_checkpoints["gemma3"][0], "lookup", compile=True, buckets=[64])
    plain, spec = plain_and_speculative(engine, REPEATING, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.stats["accepted_tokens"] > 0
    assert set(engine.compile_seconds) == {(1, 64), (K + 1, 64)}
    assert spec.stats["graphs_compiled"] == [(K + 1, 64)]
    # The int8 drafter: its target's graphs again (another engine), and the draft's own.
    int8 = load(tiny_checkpoints["gemma3"][0], "int8", compile=True, buckets=[64])
    out = int8.generate(REPEATING, max_new_tokens=40)
    assert out.token_ids == plain.token_ids and out.stats["accepted_tokens"] > 0
    draft = int8.speculator.drafter.engine
    assert set(draft.compile_seconds) == {(1, 64)}
    # Compiled, the draft steps one row at a time: no GEMM library's packed output layer.
    assert not draft.model.output_layer().packed and not draft.graphs.head_graphs
    # Over part of the vocabulary: its graph reads the rows that a later prompt's new tokens
    # write in place.
    with_draft_words(int8, 64)
    for prompt in (REPEATING, NOVEL):
        engine.clear_cache()
        plain, spec = plain_and_speculative(engine, prompt, max_new_tokens=40)
        int8.clear_cache()
        out = int8.generate(prompt, max_new_tokens=40)
        assert out.token_ids == plain.token_ids and out.stats["accepted_tokens"] > 0
    assert set(int8.speculator.drafter.engine.compile_seconds) == {(1, 64)}


def test_screened_verify_equals_plain(tiny_checkpoints):
    """With the int8 screen of the output layer (greedy_screen.py), greedy verify rows go
    through the screened graph of k + 1 rows, as plain greedy steps go through the one-row
    one: token-identical."""
    engine = load(
        tiny_checkpoints["gemma3"][0], "lookup", compile=True, buckets=[64], greedy_screen=True
    )
    plain, spec = plain_and_speculative(engine, REPEATING, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.stats["accepted_tokens"] > 0
    assert set(engine.compile_seconds) == {(1, 64, "screened"), (K + 1, 64, "screened")}


def test_an_eager_int8_draft_keeps_the_packed_output_layer(tiny_checkpoints):
    """Eager, the draft's output layer multiplies through the GEMM library's packed copy where
    the CPU has one (packed_int8.py); the compiled draft goes without (test above)."""
    draft = load(tiny_checkpoints["gemma3"][0], "int8").speculator.drafter.engine
    assert draft.model.output_layer().packed == (packed_int8.backend() is not None)


@pytest.mark.parametrize("layout", ["plain", "kernel"])
def test_draft_vocabulary_rows_are_the_embeddings_rows(tokenizer_file, layout):
    """The head's rows are the int8 embedding's rows of its tokens, in either layout, as the
    context adds tokens and, when the spare rows run out, keeps the latest; ``spread`` puts a
    distribution over the rows back on the vocabulary."""
    tokenizer = Tokenizer(tokenizer_file)
    q, scale = quant.quantize_int8(torch.randn(512, 64))
    embedding = quant.Int8Linear(64, 512, torch.float32)
    embedding.weight.copy_(q)
    embedding.scale.copy_(scale)
    vocab = DraftVocabulary(embedding, tokenizer, words=32, max_context=40)
    if layout == "kernel":
        for m in (embedding, vocab.head):
            m.to_kernel_layout(cpu.vector_lanes())
    base = base_ids(tokenizer, 512, 32)
    assert base[:32] == list(range(32)) and all(latin(tokenizer.piece(t)) for t in base[32:])
    assert vocab.rows % 64 == 0 and vocab.rows >= len(base) + 40

    def check(tokens: set[int]) -> None:
        assert set(vocab.held) == tokens
        held = torch.tensor(sorted(vocab.held.values()))
        ids = vocab.ids[held]
        expanded = vocab.head.dequantize(torch.float32)[held]
        assert torch.equal(expanded, quant.dequantize_int8(q[ids], scale[ids], torch.float32))
        assert (vocab.mask == 0).sum() == len(tokens) and (vocab.mask[held] == 0).all()

    check(set(base))
    context = list(range(100, 130)) + list(range(110, 120))  # 30 new tokens, some repeated
    vocab.add(context)
    check(set(base) | set(context))
    spare = vocab.rows - len(base)
    long_context = list(range(200, 200 + spare + 5))  # more new tokens than spare rows
    vocab.add(long_context)
    check(set(base) | set(long_context[-spare:]))
    p = torch.softmax(torch.randn(vocab.rows) + vocab.mask, dim=0)
    spread = vocab.spread(p)
    assert spread.shape == (512,) and torch.allclose(spread.sum(), torch.tensor(1.0))
    assert torch.equal(spread[vocab.ids[vocab.mask == 0]], p[vocab.mask == 0])
    assert spread[list(set(range(512)) - set(vocab.held))].sum() == 0


# -- sampling: the target's distribution ------------------------------------------------------
def test_seeded_sampling_is_reproducible(tiny_checkpoints):
    for method in ("lookup", "int8"):
        engine = load(tiny_checkpoints["gemma3"][0], method)
        kwargs = dict(max_new_tokens=30, temperature=0.7, top_k=20, top_p=0.9, seed=7)
        first = engine.generate(REPEATING, **kwargs)
        engine.clear_cache()
        assert engine.generate(REPEATING, **kwargs).token_ids == first.token_ids
        assert first.stats["drafted_tokens"] > 0


def total_variation(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


@pytest.mark.parametrize("drafted", ["sampled", "point mass"])
def test_accept_reject_keeps_the_target_distribution(drafted):
    """The first token of a step, and the token after a kept draft, over 20,000 steps with a
    fixed seed on a 6-token vocabulary: within 0.02 of the target in total variation (the
    sampling error is about 0.008 at this size)."""
    p = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15, 0.0], [0.3, 0.1, 0.2, 0.1, 0.2, 0.1]])
    q = torch.tensor([[0.3, 0.1, 0.3, 0.1, 0.1, 0.1]])  # far from p: many rejections
    generator = torch.Generator().manual_seed(0)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(20_000):
        if drafted == "sampled":
            d = int(torch.multinomial(q[0], 1, generator=generator))
            out = accept_drafts(p, [d], q, generator)
        else:
            out = accept_drafts(p, [2], None, generator)
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    assert total_variation(first, p[0]) < 0.02
    assert total_variation(second, p[1]) < 0.03  # fewer draws: only after a kept draft
    assert first[5] == 0  # never a token the target rules out


@pytest.mark.parametrize("words", [None, 64])
def test_sampled_speculation_matches_the_target_end_to_end(tiny_checkpoints, words):
    """The second new token (the first one a speculative step yields) over 240 seeds, top-k 3
    at temperature 2: its frequencies against the target's exact distribution,
    p(t2) = sum over t1 of p(t1) p(t2 | t1), computed by scoring. A wiring check (the right
    rows, the right distribution) with a loose bound; the statistics are tested above. The
    int8 drafter, which always drafts (lookup drafts only when t1 was seen before), over the
    whole vocabulary and over 64 common ids and the context's tokens (a draft distribution
    that is zero elsewhere)."""
    engine = with_draft_words(load(tiny_checkpoints["gemma3"][0], "int8"), words)
    params = SamplingParams(temperature=2.0, top_k=3)
    kwargs = dict(max_new_tokens=3, temperature=2.0, top_k=3)
    prompt = REPEATING
    first = probabilities(engine.score(prompt)[-1:], params)[0]
    target = torch.zeros(engine.config.vocab_size)
    for t1 in first.nonzero()[:, 0].tolist():
        target += first[t1] * probabilities(engine.score(prompt + [t1])[-1:], params)[0]
    counts = torch.zeros_like(target)
    drafted = 0
    for seed in range(240):
        out = engine.generate(prompt, seed=seed, **kwargs)
        counts[out.token_ids[1]] += 1
        drafted += out.stats["drafted_tokens"]
    assert drafted == 240  # each second token came from a verify step of one draft
    assert total_variation(counts, target) < 0.12  # the sampling error is about 0.06 here
    if words is not None:
        # Most of the target's mass lies outside the head's first rows (its common ids and the
        # prompt's tokens; 0.96 here): tokens the drafter proposes only once a context has
        # held them.
        held = set(base_ids(engine.tokenizer, len(target), words)) | set(prompt)
        assert target[sorted(set(range(len(target))) - held)].sum() > 0.5


# -- the real model ---------------------------------------------------------------------------
def test_real_model_lookup_greedy_equals_plain():
    """The default model, fp32, eager: a rewrite-this-text prompt, 32 tokens."""
    engine = Engine.from_pretrained(
        None, compile=False, max_seq_len=256, buckets=[256], speculate="lookup"
    )
    text = "The quick brown fox jumps over the lazy dog. " * 3
    prompt = engine.tokenizer.encode(f"Repeat this text: {text}\nRepeated: ")
    plain, spec = plain_and_speculative(engine, prompt, max_new_tokens=32)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["accepted_tokens"] > 0


def test_real_model_int8_draft_greedy_equals_plain():
    """The default model, fp32, eager, with the int8 drafter over its common words and the
    context's tokens (a head of ~10k of 262,144 rows): novel text, 24 tokens."""
    engine = Engine.from_pretrained(
        None, compile=False, max_seq_len=256, buckets=[256], speculate="int8"
    )
    assert engine.speculator.drafter.vocab.rows < engine.config.vocab_size // 16
    prompt = engine.tokenizer.encode("The history of the steam engine begins with")
    plain, spec = plain_and_speculative(engine, prompt, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["accepted_tokens"] > 0
