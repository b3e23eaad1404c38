"""Perplexity of a text under fp32, int8 and int4 weights: what quantization costs in quality.

    .venv/bin/python scripts/eval_ppl.py                      # 8 windows of 512 tokens
    .venv/bin/python scripts/eval_ppl.py --tokens 16384 --methods none,int8,int4
    .venv/bin/python scripts/eval_ppl.py --methods none,none+float16,int8,int8+float16

The text is cut into windows of --window tokens; each is scored by ``Engine.score`` in one
forward pass, starting from BOS, and every token after the first is predicted from the tokens
before it in its window. The same windows are used for every method, so the perplexities are
comparable. The default text is ../shared/data/tinyshakespeare.txt when present, else the
excerpt of it shipped in scripts/data/ (both public domain). A method ``W+D`` keeps the KV
cache in dtype D (``kv_cache_dtype``): every key and value the windows attend to is rounded to
it, so the perplexity shows what a narrower cache costs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from gemma_engine import Engine

HERE = Path(__file__).resolve().parent
TEXTS = [HERE.parent.parent / "shared" / "data" / "tinyshakespeare.txt"]
EXCERPT = HERE / "data" / "shakespeare_excerpt.txt"
# Targets of issue #5: relative increase of perplexity over fp32.
LIMITS = {"int8": 0.01, "int4": 0.05}


def windows(engine: Engine, text: str, window: int, total: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(text, add_bos=False)
    body = window - 1  # BOS takes the first slot of each window
    n = min(total, len(ids)) // body
    if n == 0:
        raise SystemExit(f"the text has {len(ids)} tokens: too short for a window of {window}")
    return [[engine.tokenizer.bos_id, *ids[i * body : (i + 1) * body]] for i in range(n)]


def perplexity(engine: Engine, chunks: list[list[int]]) -> tuple[float, int]:
    nll, count = 0.0, 0
    for ids in chunks:
        logits = engine.score(ids)  # (T, vocab), float32
        targets = torch.tensor(ids[1:])
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        nll -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count), count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the project's Gemma 3 270M")
    p.add_argument("--text", type=Path, help="a UTF-8 text file (default: see above)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of text to score, at most")
    p.add_argument("--methods", default="none,int8,int4")
    p.add_argument("--group-size", type=int, default=None, help="int4 group size")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    text_path = args.text or next((t for t in TEXTS if t.is_file()), EXCERPT)
    text = text_path.read_text(encoding="utf-8")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]

    results = {}
    chunks = None
    for method in methods:
        start = time.perf_counter()
        weights, _, kv = method.partition("+")
        engine = Engine.from_pretrained(
            args.model,
            quantize=weights,
            group_size=args.group_size if weights == "int4" else None,
            compile=False,  # score() runs the prompt path, which is eager
            max_seq_len=args.window,
            kv_cache_dtype=kv or None,
        )
        chunks = chunks or windows(engine, text, args.window, args.tokens)
        ppl, count = perplexity(engine, chunks)
        label = weights if weights != "int4" else f"int4 (groups of {engine.quantization[1]})"
        label = "fp32" if label == "none" else label
        label += f", {kv} KV cache" if kv else ""
        results[method] = (label, ppl)
        print(
            f"{label}: perplexity {ppl:.4f} over {count} tokens "
            f"({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        del engine

    base = results.get("none", (None, None))[1]
    print(f"\nText: {text_path.name}, {len(chunks)} windows of {args.window} tokens.\n")
    print("| weights | perplexity | vs fp32 | target |")
    print("|---|---|---|---|")
    for method, (label, ppl) in results.items():
        if method == "none" or base is None:
            print(f"| {label} | {ppl:.4f} | | |")
            continue
        delta = ppl / base - 1
        limit = LIMITS.get(method)  # (the targets name float caches)
        verdict = (
            "" if limit is None else f"<= {limit:.0%}: {'met' if delta <= limit else 'MISSED'}"
        )
        print(f"| {label} | {ppl:.4f} | {delta:+.2%} | {verdict} |")


if __name__ == "__main__":
    main()
