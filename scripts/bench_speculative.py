"""Speculative decoding against plain decode: exact fp32 greedy, `lookup` and `int8` drafting.
Not a test: run it on a quiet machine.

One engine (fp32, compiled, one row, one kv bucket covering prompt + generation) decodes two
prompts greedily: a novel-text prompt (a Shakespeare excerpt from /work/shared/data, to be
continued) and a rewrite-this-text prompt (the same excerpt, then an instruction to write it
out again, and its first words). Each mode runs on the same engine, so the plain one-row graph
is shared and the speculators add their verify graph (k + 1 rows) and the int8 draft's own:

- plain: no speculation;
- lookup: prompt-lookup drafting, ``--tokens-per-step`` (k) drafts;
- int8: an int8 copy of the model drafting k tokens, its output layer cut to the common words
  and the context's (draft_vocabulary.py);
- int8-all (only when named in ``--modes``): the same over the whole vocabulary.

A warm-up generation of each mode and prompt compiles first (and checks that its tokens are
the plain ones: "identical" in the table); then ``--repeats`` rounds in which the modes take
turns, each generation reporting its decode tok/s (``Generation.stats``). The table shows each
mode's median with the acceptance rate (drafts kept / drafted) and the speedup over plain.
The cost of verifying k drafts: the median time of one (k + 1)-row verify step against one
plain step, at the rewrite prompt's length.

    .venv/bin/python scripts/bench_speculative.py [--tokens 128] [--repeats 5]
        [--tokens-per-step 4] [--modes plain,lookup,int8,int8-all] [--append] [--json out.json]
    .venv/bin/python scripts/bench_speculative.py --smoke   # eager, tiny: does it run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

from gemma_engine import Engine  # noqa: E402
from gemma_engine.speculative import Speculator  # noqa: E402

CORPUS = Path("/work/shared/data/tinyshakespeare.txt")
MODES = ("plain", "lookup", "int8", "int8-all")
DEFAULT_MODES = ("plain", "lookup", "int8")


def excerpt(chars: int, offset: int) -> str:
    """Whole lines of the corpus from ``offset``, about ``chars`` characters."""
    text = CORPUS.read_text(encoding="utf-8")
    start = text.index("\n\n", offset) + 2
    end = text.index("\n", start + chars)
    return text[start:end]


def prompts(chars: int) -> dict[str, str]:
    novel = excerpt(chars, 200_000)
    rewrite = excerpt(chars, 600_000)
    first = " ".join(rewrite.split()[:6])
    return {
        "novel": novel + "\n",
        "rewrite": f"{rewrite}\n\nWrite the text above out again, word for word.\n\n{first}",
    }


def step_seconds(engine: Engine, rows: int, pos: int, repeats: int) -> float:
    """Median seconds of one greedy decode step of ``rows`` rows of one sequence at ``pos``
    (``Engine.greedy_step``: through the int8 screen of the output layer where the engine has
    one, as greedy requests and their verify steps run)."""
    tokens = torch.full((rows, 1), 1000)
    positions = torch.arange(pos, pos + rows)
    kv_len = engine.bucket_for(pos + rows)
    where = torch.zeros(rows, dtype=torch.long)
    samples = []
    for _ in range(repeats + 1):  # the first call may compile
        start = time.perf_counter()
        engine.greedy_step(tokens, positions, kv_len, where)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    texts = prompts(args.chars)
    engine = Engine.from_pretrained(
        args.model,
        compile=not args.no_compile,
        max_seq_len=args.bucket,
        buckets=[args.bucket],
        max_batch=1,
    )
    engine.on_compile = lambda text: print(f"  {text}", flush=True)
    k = args.tokens_per_step
    speculators = {
        "plain": None,
        "lookup": Speculator(engine, "lookup", k) if "lookup" in args.modes else None,
        "int8": Speculator(engine, "int8", k) if "int8" in args.modes else None,
        "int8-all": (
            Speculator(engine, "int8", k, draft_words=None) if "int8-all" in args.modes else None
        ),
    }
    ids = {name: engine.tokenizer.encode(text) for name, text in texts.items()}
    kwargs = dict(max_new_tokens=args.tokens)

    def generate(mode: str, prompt_ids: list[int]):
        engine.speculator = speculators[mode]
        engine.clear_cache()
        return engine.generate(prompt_ids, **kwargs)

    rows = []
    for prompt, prompt_ids in ids.items():
        # A warm-up generation of each mode compiles its graphs and gives the tokens to
        # compare; then the modes take turns, so that a slower phase of the machine falls
        # on all of them alike (the VM's speed drifts by 10-20% over minutes).
        warm = {mode: generate(mode, prompt_ids) for mode in args.modes}
        rates = {mode: [] for mode in args.modes}
        drafted = dict.fromkeys(args.modes, 0)
        kept = dict.fromkeys(args.modes, 0)
        for _ in range(args.repeats):
            for mode in args.modes:
                out = generate(mode, prompt_ids)
                rates[mode].append(out.stats["decode_tokens_per_second"] or 0.0)
                drafted[mode] += out.stats["drafted_tokens"]
                kept[mode] += out.stats["accepted_tokens"]
        for mode in args.modes:
            row = {
                "prompt": prompt,
                "prompt_tokens": len(prompt_ids),
                "mode": mode,
                "new_tokens": len(warm[mode].token_ids),
                "tok_s": statistics.median(rates[mode]),
                "tok_s_all": rates[mode],
                "acceptance": kept[mode] / drafted[mode] if drafted[mode] else None,
                "drafted_per_run": drafted[mode] / args.repeats,
                # each round's tok/s over plain's in the same round
                "per_round": [a / b for a, b in zip(rates[mode], rates["plain"], strict=True)],
                "identical": warm[mode].token_ids == warm["plain"].token_ids,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    engine.speculator = None
    pos = len(ids["rewrite"]) + args.tokens // 2
    with torch.no_grad():
        plain = step_seconds(engine, 1, pos, args.step_repeats)
        verify = step_seconds(engine, k + 1, pos, args.step_repeats)
    cost = {"position": pos, "k": k, "step_ms": plain * 1e3, "verify_ms": verify * 1e3}
    cost["screened"] = engine.screens
    for mode in ("int8", "int8-all"):  # one step of each int8 draft
        if speculators[mode] is not None:
            draft = speculators[mode].drafter.engine
            with torch.no_grad():
                cost[f"{mode}_draft_ms"] = step_seconds(draft, 1, pos, args.step_repeats) * 1e3
    print(json.dumps(cost), flush=True)
    return {"rows": rows, "verify_cost": cost}


def _per_round(ratios: list[float] | None) -> str:
    """The median of the rounds' ratios to plain, and their range."""
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


def markdown(results: dict, args) -> str:
    base = {r["prompt"]: r["tok_s"] for r in results["rows"] if r["mode"] == "plain"}
    rows = []
    for r in results["rows"]:
        rows.append(
            [
                f"{r['prompt']} ({r['prompt_tokens']} tokens)",
                r["mode"],
                f"{r['tok_s']:.1f}",
                f"{r['tok_s'] / base[r['prompt']]:.2f}x" if base.get(r["prompt"]) else "",
                "" if r["mode"] == "plain" else _per_round(r.get("per_round")),
                "" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
                f"{r['drafted_per_run']:.0f}",
                "yes" if r["identical"] else "**no**",
            ]
        )
    head = ["prompt", "mode", "decode tok/s", "vs plain", "per round", "drafts kept", "drafted"]
    head.append("identical")
    table = bu.md_table(head, rows, "llrrrrrl")
    c = results["verify_cost"]
    cost = (
        f"Verifying k = {c['k']} drafts (one step of {c['k'] + 1} rows at position "
        f"{c['position']}): {c['verify_ms']:.1f} ms against {c['step_ms']:.1f} ms for one plain "
        f"step ({c['verify_ms'] / c['step_ms']:.2f}x)."
    )
    if c.get("screened"):
        cost += (
            " Greedy steps, plain and verify, read the int8 screen of the output layer "
            "(greedy_screen.py)."
        )
    for mode in ("int8", "int8-all"):
        if f"{mode}_draft_ms" in c:
            cost += f" One step of the {mode} draft: {c[f'{mode}_draft_ms']:.1f} ms."
    return f"{table}\n\n{cost}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: Gemma 3 270M")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    p.add_argument("--tokens-per-step", type=int, default=4, help="k, drafts per step")
    p.add_argument("--chars", type=int, default=1200, help="length of the excerpt")
    p.add_argument("--bucket", type=int, default=1024, help="max_seq_len and the one kv bucket")
    p.add_argument("--repeats", type=int, default=5, help="rounds in which the modes alternate")
    p.add_argument(
        "--modes",
        type=lambda text: [m for m in text.split(",") if m],
        default=list(DEFAULT_MODES),
        help=f"comma-separated, from {','.join(MODES)} (plain always runs: the baseline; "
        f"default {','.join(DEFAULT_MODES)})",
    )
    p.add_argument("--step-repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--smoke", action="store_true", help="eager, tiny settings: does it run")
    p.add_argument("--append", action="store_true", help="append a dated section to BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    args.modes = [m for m in MODES if m == "plain" or m in args.modes]
    if args.smoke:
        args.tokens, args.chars, args.bucket, args.repeats, args.step_repeats = 12, 200, 256, 1, 2
        args.no_compile = True
    info = bu.machine_info("cpu", args.threads)
    print(f"machine: {bu.machine_line(info)}\nversions: {bu.versions_line(info)}", flush=True)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": info, **run(args)}
    table = markdown(results, args)
    print(table)
    if args.json:
        bu.atomic_write_json(args.json, results)
    if args.append:
        section = (
            f"## Speculative decoding, {info['date_utc']}\n\n"
            f"Machine: {bu.machine_line(info)}\n\nVersions: {bu.versions_line(info)}\n\n"
            f"Command: `{bu.command_line(argv)}`\n\n"
            f"Exact fp32 greedy, {args.tokens} new tokens, k = {args.tokens_per_step}, medians of "
            f"{args.repeats} rounds in which the modes alternate (a warm-up run of each first; "
            "`per round`: the median and range of each round's ratio to plain; `identical`: the "
            "same tokens as plain).\n\n"
            f"{table}\n"
        )
        bu.append_section(bu.BENCHMARKS_MD, section)
        print(f"appended to {bu.BENCHMARKS_MD}", flush=True)


if __name__ == "__main__":
    main()
