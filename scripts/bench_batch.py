"""Batched decoding: aggregate and per-request decode tokens/s at B = 1, 2, 4, 8, and the time to
first token of a chat's 6th turn with and without prefix reuse. Not a test: run it on a quiet
machine.

For each weight format (``--weights fp32,int8``) one engine holds ``max(--batches)`` rows with
one kv bucket covering prompt + generation (so a batch size is one graph); a warm-up batch of
each size compiles first. A batch of B distinct random prompts of ``--prompt-len`` tokens is
then submitted at once, greedy, ``--tokens`` new tokens each (EOS ignored, so that every
request runs its full length). Reported per B: aggregate tokens/s (all new tokens over the
batch's wall time, prompts included), the decode-only aggregate (the sum of each request's
own decode rate: its tokens over the steps it ran in), and the mean per-request decode rate.

transformers runs the same prompts as one left-padded batch (``generate``, greedy,
``min_new_tokens`` = ``max_new_tokens``), timed as generate(N) minus generate(1). llama.cpp
decodes B sequences in parallel with its own ``llama-batched-bench`` (``make
llama-batched-bench`` builds it from the vendored source of the llama-cpp-python sdist), on
the default model's Q4_K_M GGUF: its S_TG column (B x TG tokens over the generation time).

``--bucket-contexts`` (the seed experiment in the batched regime): one step of B=8 rows at
position ctx - 1 through the graph of the kv bucket against the graph reading the whole
``max_seq_len`` buffer, at each context.

``--batched-linear gemm`` makes the engine's batched CPU decode use F.linear instead of the
fused multiply-reduce (layers.BATCHED_FUSED), to compare the two end to end.

``--plot PNG`` draws aggregate and per-request decode rates against B for every contestant;
``--markdown`` prints the tables that BENCHMARKS.md holds.

    .venv/bin/python scripts/bench_batch.py [--weights fp32,int8] [--batches 1,2,4,8]
        [--json out.json] [--plot docs/bench_batch_cpu.png] [--markdown]
    .venv/bin/python scripts/bench_batch.py --smoke   # seconds: does it run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402
from bench import default_gguf  # noqa: E402

from gemma_engine import Engine, layers  # noqa: E402
from gemma_engine.gguf import ensure_default_model  # noqa: E402


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [2, *torch.randint(1000, vocab, (length - 1,), generator=g).tolist()] for _ in range(batch)
    ]


def engine_batches(args, weights: str) -> list[dict]:
    ctx = args.prompt_len + args.tokens
    engine = Engine.from_pretrained(
        args.model,
        quantize=None if weights == "fp32" else weights,
        compile=not args.no_compile,
        max_seq_len=ctx,
        buckets=[ctx],
        max_batch=max(args.batches),
    )
    engine.eos_token_ids = set()  # every request runs its full length
    vocab = engine.config.vocab_size
    rows = []
    for b in args.batches:  # warm-up: compiles the graph of each batch size
        # One request is admitted per step, so each runs b + 2 tokens: all b decode together.
        warm = prompts_for(b, args.prompt_len, vocab, 0)
        for r in [engine.submit(p, max_new_tokens=b + 2) for p in warm]:
            r.result()
    for b in args.batches:
        engine.clear_cache()
        prompts = prompts_for(b, args.prompt_len, vocab, seed=b)
        start = time.perf_counter()
        results = [
            r.result() for r in [engine.submit(p, max_new_tokens=args.tokens) for p in prompts]
        ]
        wall = time.perf_counter() - start
        rates = [g.stats["decode_tokens_per_second"] or 0.0 for g in results]
        rows.append(
            {
                "engine": f"gemma-engine {weights}",
                "batch": b,
                "aggregate_tok_s": sum(len(g.token_ids) for g in results) / wall,
                "decode_aggregate_tok_s": sum(rates),
                "per_request_tok_s": sum(rates) / len(rates),
                "graphs": sorted(engine.compile_seconds),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    del engine
    gc.collect()
    return rows


def llama_cpp_batches(args) -> list[dict]:
    exe = args.llama_batched_bench
    if not exe.is_file():
        print(f"llama.cpp: {exe} not found (make llama-batched-bench); skipped", flush=True)
        return []
    gguf = default_gguf()
    if gguf is None:
        print("llama.cpp: the default model's GGUF package is not installed; skipped", flush=True)
        return []
    pp, tg = args.prompt_len, args.tokens
    cmd = [str(exe), "-m", gguf, "-c", str(max(args.batches) * (pp + tg))]
    cmd += ["-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(tg)]
    cmd += ["-npl", ",".join(map(str, args.batches)), "-t", str(args.threads)]
    cmd += ["-tb", str(args.threads), "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows.append(
                {
                    "engine": "llama.cpp Q4_K_M",
                    "batch": r["pl"],
                    "decode_aggregate_tok_s": r["speed_tg"],
                    "per_request_tok_s": r["speed_tg"] / r["pl"],
                    "prompt_tok_s": r["speed_pp"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bucket_experiment(args) -> list[dict]:
    """B=8 decode steps: the kv bucket's graph against the full buffer's, per context."""
    contexts = [int(c) for c in args.bucket_contexts.split(",")]
    full = max(contexts)
    engine = Engine.from_pretrained(
        args.model,
        quantize=None if args.bucket_weights == "fp32" else args.bucket_weights,
        compile=not args.no_compile,
        max_seq_len=full,
        buckets=sorted(set(contexts)),
        max_batch=8,
    )
    tokens = torch.full((8, 1), 1000)
    rows_ = torch.arange(8)
    out = []
    with torch.no_grad():
        for ctx in contexts:
            pos = torch.full((8, 1), ctx - 1)
            times = {}
            for label, kv in (("bucketed", ctx), ("full", full)):
                for _ in range(3):  # compiles the pair's graph once, then warms up
                    engine.step(tokens, pos, kv, rows_)
                samples = []
                for _ in range(args.bucket_repeats):
                    start = time.perf_counter()
                    engine.step(tokens, pos, kv, rows_)
                    samples.append(time.perf_counter() - start)
                times[label] = statistics.median(samples)
            row = {
                "context": ctx,
                "weights": args.bucket_weights,
                "bucketed_ms": 1e3 * times["bucketed"],
                "full_ms": 1e3 * times["full"],
                "speedup": times["full"] / times["bucketed"],
            }
            out.append(row)
            print(json.dumps({"bucket_b8": row}), flush=True)
    del engine
    gc.collect()
    return out


def transformers_batches(args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    rows = []
    for b in args.batches:
        ids = torch.tensor(prompts_for(b, args.prompt_len, vocab, seed=b))
        mask = torch.ones_like(ids)  # equal lengths: the left padding is empty

        def run(n: int, ids=ids, mask=mask) -> float:
            start = time.perf_counter()
            with torch.no_grad():
                hf.generate(
                    ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
                )
            return time.perf_counter() - start

        run(2)  # warm-up
        seconds = run(args.tokens) - run(1)
        rows.append(
            {
                "engine": "transformers fp32",
                "batch": b,
                "decode_aggregate_tok_s": b * (args.tokens - 1) / seconds,
                "per_request_tok_s": (args.tokens - 1) / seconds,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def chat_ttft(args) -> dict:
    """Five turns of about ``--history / 5`` tokens each, then the 6th: its first token."""
    # Room for the turns' markers and replies: a decoded message re-encodes to more tokens.
    engine = Engine.from_pretrained(
        args.model,
        compile=not args.no_compile,
        max_seq_len=2 * args.history + 512,
        max_batch=1,
    )
    vocab = engine.config.vocab_size
    turn_len = args.history // 5
    history: list[int] = []
    for turn in range(6):
        message = prompts_for(1, turn_len, vocab, seed=100 + turn)[0][1:]
        history += engine.chat_prompt(engine.tokenizer.decode(message))[0 if turn == 0 else 1 :]
        if turn == 4:
            turn5 = list(history)
        if turn < 5:
            history += engine.generate(history, max_new_tokens=8).token_ids
    out = {}
    for mode in ("reuse", "fresh"):
        engine.clear_cache()
        if mode == "reuse":  # turn 5 again (greedy: the same reply): the slot holds turns 1-5
            engine.generate(turn5, max_new_tokens=8)
        g = engine.generate(history, max_new_tokens=1)
        out[mode] = {
            "ttft_s": g.stats["prefill_seconds"],
            "cached_tokens": g.stats["cached_tokens"],
        }
    out["prompt_tokens"] = len(history)
    print(json.dumps({"chat_6th_turn": out}), flush=True)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    engines = dict.fromkeys(r["engine"] for r in results["rows"])
    for name in engines:
        rows = sorted((r for r in results["rows"] if r["engine"] == name), key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        axes[0].plot(batches, [r["decode_aggregate_tok_s"] for r in rows], "o-", label=name)
        axes[1].plot(batches, [r["per_request_tok_s"] for r in rows], "o-", label=name)
    for ax, title in zip(axes, ("aggregate decode tok/s", "per-request decode tok/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["batches"], [str(b) for b in results["batches"]])
        ax.set_xlabel("concurrent sequences (B)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(
        f"Gemma 3 270M, batched decode; {m.get('cpu', 'CPU')}, capability "
        f"{m.get('capability')}, {m.get('torch_threads')} threads, {m.get('date_utc')}"
    )
    fig.tight_layout()
    bu.save_figure(fig, path)


def markdown(results: dict) -> str:
    batches = results["batches"]
    by = {(r["engine"], r["batch"]): r for r in results["rows"]}
    engines = list(dict.fromkeys(r["engine"] for r in results["rows"]))
    out = []
    for key, title in (
        ("decode_aggregate_tok_s", "aggregate decode tok/s"),
        ("per_request_tok_s", "per-request decode tok/s"),
    ):
        rows = []
        for name in engines:
            cells = [f"{by[name, b][key]:.1f}" if (name, b) in by else "" for b in batches]
            base = by.get((name, batches[0]))
            top = by.get((name, batches[-1]))
            scale = f"{top[key] / base[key]:.2f}x" if base and top and base[key] else ""
            rows.append([name, *cells, scale])
        head = [title, *(f"B={b}" for b in batches), f"B={batches[-1]} / B={batches[0]}"]
        out.append(bu.md_table(head, rows, "l" + "r" * (len(batches) + 1)))
    if results.get("bucket_b8"):
        rows = [
            [
                str(r["context"]),
                f"{r['bucketed_ms']:.1f}",
                f"{r['full_ms']:.1f}",
                f"{r['speedup']:.2f}x",
            ]
            for r in results["bucket_b8"]
        ]
        head = ["context (B=8)", "bucketed step ms", "full-buffer step ms", "speedup"]
        out.append(bu.md_table(head, rows, "lrrr"))
    if results.get("chat"):
        c = results["chat"]
        rows = [
            [mode, f"{c[mode]['ttft_s'] * 1e3:.0f}", str(c[mode]["cached_tokens"])]
            for mode in ("reuse", "fresh")
        ]
        head = [f"6th turn ({c['prompt_tokens']} prompt tokens)", "TTFT ms", "cached tokens"]
        out.append(bu.md_table(head, rows, "lrr"))
    return "\n\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: Gemma 3 270M")
    p.add_argument("--weights", default="fp32,int8")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--history", type=int, default=2000, help="chat history tokens before turn 6")
    p.add_argument("--batched-linear", choices=["fused", "gemm"], default="fused")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument(
        "--llama-batched-bench", type=Path, default=Path(".llama/bin/llama-batched-bench")
    )
    p.add_argument("--bucket-contexts", default="1024,2048,4096,8192", help="'' skips it")
    p.add_argument("--bucket-weights", default="fp32")
    p.add_argument("--bucket-repeats", type=int, default=10)
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny settings, eager: does it run")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write a PNG of the rates against B here")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    info = bu.machine_info("cpu", args.threads)
    bandwidth = bu.measure_bandwidth("cpu")
    print(f"machine: {bu.machine_line(info)}\nversions: {bu.versions_line(info)}", flush=True)
    print(f"memory bandwidth: {json.dumps(bandwidth)}", flush=True)
    if args.smoke:
        args.weights, args.batches, args.prompt_len, args.tokens = "fp32", "1,2", 8, 4
        args.history, args.no_compile = 100, True
        args.bucket_contexts, args.bucket_repeats = "64,128", 2
    args.model = str(args.model or ensure_default_model())
    args.batches = [int(b) for b in args.batches.split(",")]
    layers.BATCHED_FUSED = args.batched_linear == "fused"
    results = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": info,
        "bandwidth": bandwidth,
        "batches": args.batches,
        "rows": [],
    }
    for weights in args.weights.split(","):
        results["rows"] += engine_batches(args, weights)
    if not args.no_transformers:
        results["rows"] += transformers_batches(args)
    if not args.no_llama_cpp:
        results["rows"] += llama_cpp_batches(args)
    if args.bucket_contexts:
        results["bucket_b8"] = bucket_experiment(args)
    if not args.no_chat:
        results["chat"] = chat_ttft(args)
    if args.json:
        bu.atomic_write_json(args.json, results)
    if args.plot:
        plot(results, args.plot)
    if args.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
