"""Many requests at once: a batch gives each request exactly what it gets alone.

Solo runs are the reference here; they are themselves checked against transformers by the
parity tests, and one batched step is checked against transformers directly below. The tiny
models have a window of 8 and the engines a prompt chunk of 4, so sliding rings (8 + 4 entries)
wrap many times inside these sequences.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gemma_engine import Engine, cpu, quant
from gemma_engine.slots import SlotTable, batch_buckets

BUCKETS = [16, 32, 64]
CHUNK = 4


def ids_for(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(folder, compile: bool = False, max_batch: int = 4, **kwargs) -> Engine:
    kwargs = {"max_seq_len": 64, "buckets": BUCKETS, "prefill_chunk": CHUNK, **kwargs}
    return Engine.from_pretrained(folder, compile=compile, max_batch=max_batch, **kwargs)


def run_together(engine: Engine, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    requests = [engine.submit(p, **kwargs) for p in prompts]
    return [r.result().token_ids for r in requests]


def run_alone(engine: Engine, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    out = []
    for p in prompts:
        engine.clear_cache()  # no prefix reuse between the reference runs
        out.append(engine.generate(p, **kwargs).token_ids)
    engine.clear_cache()
    return out


# Lengths that start in different buckets; 30 new tokens carry each across a boundary.
LENGTHS = [3, 9, 14, 21]


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_batched_equals_solo(kind, tiny_checkpoints):
    """Eager, across the buckets 16, 32 and 64; compiled, see the graph-count test."""
    engine = load(tiny_checkpoints[kind][0])
    prompts = [ids_for(n, seed=n) for n in LENGTHS]
    alone = run_alone(engine, prompts, max_new_tokens=30)
    together = run_together(engine, prompts, max_new_tokens=30)
    assert together == alone
    assert all(len(t) == 30 for t in together)


@pytest.mark.parametrize("kind", ["gemma4", "gemma4_moe"])
def test_batched_equals_solo_gemma4(kind, tiny_new_checkpoints):
    """KV sharing and per-layer embeddings (dense), experts (MoE) in a batch."""
    engine = load(tiny_new_checkpoints[kind][0], max_batch=3)
    prompts = [ids_for(n, seed=n) for n in (5, 12, 19)]
    alone = run_alone(engine, prompts, max_new_tokens=25)
    assert run_together(engine, prompts, max_new_tokens=25) == alone


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_batched_rows_equal_one_row(method):
    """A batched decode step's quantized product (compiled, on CPU) is the one-token kernel
    per row: each row exactly as alone, and the product of the dequantized matrix. (A whole
    compiled quantized engine per batch size costs minutes of compiling here.)"""
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(64, 48, bias=False)
    torch.nn.init.normal_(holder.proj.weight, std=0.1)
    quant.quantize_model(holder, method, 16, torch.float32)
    quant.to_kernel_layout(holder)
    step = torch.compile(lambda x: holder.proj(x), fullgraph=True, dynamic=False)
    x = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), cpu.compile_config():
        batched = step(x)
        alone = torch.cat([step(x[i : i + 1]) for i in range(3)])
    assert torch.equal(batched, alone)
    expected = F.linear(x, holder.proj.dequantize(torch.float32))
    torch.testing.assert_close(batched, expected, atol=1e-4, rtol=1e-4)


def test_batched_step_matches_transformers(tiny_checkpoints):
    """One step of two sequences of different lengths, in swapped cache rows, with two
    padded rows, against transformers' logits of each full sequence."""
    folder, reference = tiny_checkpoints["gemma3"]
    engine = load(folder, max_batch=4)
    seqs = [ids_for(27, seed=1), ids_for(11, seed=2)]
    rows = [1, 0]
    with torch.no_grad():
        for row, ids in zip(rows, seqs, strict=True):
            for start in range(0, len(ids) - 1, CHUNK):
                engine.prefill(ids[start : min(start + CHUNK, len(ids) - 1)], start, row, False)
        tokens = torch.tensor([[s[-1]] for s in seqs] + [[0], [0]])
        positions = torch.tensor([len(s) - 1 for s in seqs] + [0, 0])
        kv_len = engine.bucket_for(27)
        logits = engine.step(tokens, positions, kv_len, torch.tensor([*rows, 2, 3]))[:, -1]
        expected = [reference(torch.tensor([s])).logits[0, -1] for s in seqs]
    assert torch.isfinite(logits).all()  # padded rows too
    torch.testing.assert_close(logits[:2], torch.stack(expected), atol=1e-4, rtol=0)


def test_real_model_batched_equals_solo():
    """The default model, fp32: eager across buckets with four rows, compiled with two."""
    eager = Engine.from_pretrained(
        None, compile=False, max_seq_len=64, buckets=[16, 32, 64], max_batch=4
    )
    prompts = [
        eager.tokenizer.encode(t)
        for t in (
            "The capital of France is",
            "Here is a short poem about the sea and the sky, written by a child:",
            "def fibonacci(n):",
            "List three facts about the planet Mars, the fourth planet from the sun, in a "
            "numbered list with one short sentence each.",
        )
    ]
    alone = run_alone(eager, prompts, max_new_tokens=20)  # 6-25 prompt tokens: crosses 16 and 32
    assert run_together(eager, prompts, max_new_tokens=20) == alone
    # Compiled (the slow part, ~2 min: two graphs of the real model): one kv
    # bucket, batch buckets 1 and 2, greedy through the int8 screen (greedy_screen.py).
    compiled = Engine.from_pretrained(None, compile=True, max_seq_len=64, buckets=[64], max_batch=2)
    together = run_together(compiled, prompts[:2], max_new_tokens=12)
    assert together == [tokens[:12] for tokens in alone[:2]]
    assert sorted(compiled.compile_seconds) == [(1, 64, "screened"), (2, 64, "screened")]


@pytest.fixture(scope="module")
def engine(tiny_checkpoints) -> Engine:
    return load(tiny_checkpoints["gemma3"][0], max_batch=4)


@pytest.mark.parametrize(
    "needle_kwargs",
    [dict(max_new_tokens=40), dict(max_new_tokens=40, temperature=1.0, top_k=40, seed=11)],
    ids=["greedy", "seeded"],
)
def test_needle_among_random_fillers(engine, needle_kwargs):
    """A request is unchanged by batch mates that arrive and finish at random steps (more of
    them than slots, so some wait in the queue); a seeded one draws the same tokens."""
    needle = ids_for(10, seed=99)
    engine.clear_cache()
    expected = engine.generate(needle, **needle_kwargs).token_ids
    rng = random.Random(0)
    for n_fillers in range(2, engine.max_batch + 1):
        engine.clear_cache()
        request = engine.submit(needle, **needle_kwargs)
        fillers = []
        arrivals = sorted(rng.sample(range(25), n_fillers))
        for i, _ in enumerate(request):  # each piece: the needle has advanced a step or more
            while arrivals and arrivals[0] <= i:
                arrivals.pop(0)
                filler = ids_for(rng.randint(1, 30), seed=rng.randint(0, 10**6))
                sampled = (
                    dict(temperature=0.9, seed=rng.randint(0, 99)) if rng.random() < 0.5 else {}
                )
                fillers.append(engine.submit(filler, max_new_tokens=rng.randint(1, 30), **sampled))
        assert request.result().token_ids == expected, f"with {n_fillers} fillers"
        for f in fillers:
            f.result()
    assert engine.scheduler.slots.free() == engine.max_batch


def test_cancellation_frees_the_slot_and_changes_no_one(engine):
    needle, other = ids_for(6, seed=5), ids_for(8, seed=6)
    engine.clear_cache()
    expected = engine.generate(needle, max_new_tokens=40).token_ids
    engine.clear_cache()
    expected_other = engine.generate(other, max_new_tokens=50).token_ids
    engine.clear_cache()
    keep = engine.submit(needle, max_new_tokens=40)
    doomed = [engine.submit(other, max_new_tokens=50) for _ in range(3)]  # the slots fill
    queued = engine.submit(other, max_new_tokens=50)  # the fifth request waits
    queued.cancel()
    while not doomed[0].new_ids:  # it runs (its text may come later: bytes of a character)
        engine.scheduler.advance()  # nothing waits on a request yet: this thread drives
    doomed[0].cancel()
    late = engine.submit(ids_for(4, seed=7), max_new_tokens=5)  # takes the freed slot
    assert len(late.result().token_ids) == 5
    assert keep.result().token_ids == expected
    cancelled = doomed[0].result()
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 50
    assert queued.result().finish_reason == "cancelled" and queued.result().token_ids == []
    assert [d.result().token_ids for d in doomed[1:]] == [expected_other] * 2
    assert engine.scheduler.slots.free() == engine.max_batch


def test_closing_a_stream_frees_its_slot(engine):
    engine.clear_cache()
    stream = engine.stream(ids_for(6, seed=8), max_new_tokens=50)
    next(stream)
    stream.close()  # as a client that stops reading does
    assert engine.last_stats["decode_tokens"] < 49
    assert engine.scheduler.slots.free() == engine.max_batch


def test_waiting_threads_drive_and_hand_over(engine):
    """Two threads each generate at once: whichever waits runs the steps for both, and hands
    over when its own request ends; each gets what it gets alone."""
    prompts = [ids_for(7, seed=21), ids_for(12, seed=22)]
    budgets = [8, 30]  # the first thread stops driving long before the second's request ends
    alone = []
    for p, n in zip(prompts, budgets, strict=True):
        engine.clear_cache()
        alone.append(engine.generate(p, max_new_tokens=n).token_ids)
    engine.clear_cache()
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = engine.generate(prompts[i], max_new_tokens=budgets[i]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(0), got.get(1)] == alone


def test_run_forever_serves_requests_from_other_threads(engine):
    """A server's engine thread drives for good; callers elsewhere only submit and wait."""
    prompt = ids_for(9, seed=31)
    engine.clear_cache()
    solo = engine.generate(prompt, max_new_tokens=12)
    expected = solo.token_ids
    engine.clear_cache()
    stop = threading.Event()
    loop = threading.Thread(target=engine.scheduler.run_forever, args=(stop,))
    loop.start()
    try:
        requests = [engine.submit(prompt, max_new_tokens=12) for _ in range(3)]
        assert [r.result(timeout=120).token_ids for r in requests] == [expected] * 3
        pieces = "".join(engine.submit(prompt, max_new_tokens=12))  # iterating waits too
        assert pieces == solo.text
    finally:
        stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive()


# -- prefix reuse ------------------------------------------------------------------------
def test_reuse_rule_at_the_ring_boundary():
    """A slot that wrote 29 positions into rings of 12 (window 8) still holds 17..28: a prefix
    of p tokens needs p-7..p-1, so p = 24 is reusable and p = 23 is not."""
    table = SlotTable(1, 64, window=8, ring=12)
    ids = list(range(100, 129))
    slot, _ = table.acquire(ids)
    table.wrote(slot, ids, 0)
    table.release(slot)
    assert table.reusable(slot, ids[:24] + [1]) == 24
    assert table.reusable(slot, ids[:23] + [1]) == 0
    assert table.reusable(slot, ids[:3] + [1]) == 0  # needs 0..2, overwritten long ago
    assert SlotTable(1, 64, window=None, ring=64).reusable(slot, ids[:3] + [1]) == 3
    assert batch_buckets(4) == [1, 2, 4] and batch_buckets(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("kind", ["gemma", "gemma3"])
def test_reused_prefix_gives_a_fresh_prefill_s_tokens(kind, tiny_checkpoints):
    """Reuse, compared with the same prompt prefilled from scratch: greedy tokens, and
    sampled ones (which depend on the whole distribution), and cached_tokens exactly."""
    engine = load(tiny_checkpoints[kind][0], max_batch=2)
    first_prompt = ids_for(20, seed=3)
    engine.clear_cache()
    first = engine.generate(first_prompt, max_new_tokens=10)
    written = 20 + 9  # the last token sampled is never fed
    held = first_prompt + first.token_ids[:9]
    ring = engine.model.ring
    sliding = kind == "gemma3"
    for p in (written, 24, 23, 20, 5):
        new = ids_for(6, seed=p)
        if p < len(held):  # shares exactly p tokens with the slot
            new[0] = 4 + (held[p] - 3) % 508
        prompt = held[:p] + new
        reusable = not sliding or written - ring <= max(0, p - 8 + 1)
        for kwargs in (dict(max_new_tokens=15), dict(max_new_tokens=15, temperature=1.0, seed=2)):
            engine.clear_cache()
            fresh = engine.generate(prompt, **kwargs)
            assert fresh.stats["cached_tokens"] == 0
            engine.clear_cache()
            assert engine.generate(first_prompt, max_new_tokens=10).token_ids == first.token_ids
            reused = engine.generate(prompt, **kwargs)
            assert reused.stats["cached_tokens"] == (p if reusable else 0), p
            assert reused.token_ids == fresh.token_ids, p


def test_chat_turns_prefill_only_the_new_turn(tiny_checkpoints):
    engine = load(tiny_checkpoints["gemma"][0], max_batch=2, max_seq_len=256, buckets=[256])
    history: list[int] = []
    previous = 0  # tokens the slot holds: all but the last token of each reply
    for turn in range(3):
        history += engine.chat_prompt(f"question {turn}")[0 if not history else 1 :]
        reply = engine.generate(history, max_new_tokens=8)
        assert reply.stats["cached_tokens"] == previous
        previous = len(history) + len(reply.token_ids) - 1
        history += reply.token_ids


def test_compiled_batched_equals_solo_one_graph_per_pair(tiny_checkpoints):
    """Compiled (two rows, buckets 32 and 64: four graphs at most, each built once): a batch
    equals the solo runs across the bucket boundary, and reuse builds no graph."""
    torch._dynamo.reset()
    engine = load(tiny_checkpoints["gemma3"][0], compile=True, max_batch=2, buckets=[32, 64])
    prompts = [ids_for(n, seed=n) for n in (9, 21)]
    graphs = counters["stats"]["unique_graphs"]
    alone = run_alone(engine, prompts, max_new_tokens=20)  # to position 40: both buckets
    together = run_together(engine, prompts, max_new_tokens=20)
    assert together == alone
    pairs = set(engine.compile_seconds)
    assert (2, 32) in pairs and pairs <= {(1, 32), (1, 64), (2, 32), (2, 64)}
    assert counters["stats"]["unique_graphs"] - graphs <= len(pairs)  # 0 if saved whole
    # Each prompt again with its reply (all of it that was fed) and one more token: only that
    # token is prefilled. The second time, the slots have run 5 tokens past that prefix, more
    # than a chunk (4) allows: the rings no longer hold the window before it, nothing is reused.
    longer = [p + t[:19] + [5] for p, t in zip(prompts, together, strict=True)]
    for cached in ([28, 40], [0, 0]):
        before = set(engine.compile_seconds)
        requests = [engine.submit(p, max_new_tokens=6) for p in longer]
        assert [r.result().stats["cached_tokens"] for r in requests] == cached
        assert counters["stats"]["unique_graphs"] - graphs <= len(engine.compile_seconds)
    assert set(engine.compile_seconds) == before  # the same shapes again: no graph
