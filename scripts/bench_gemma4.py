"""Decode speed of Gemma 4 shapes: gemma-engine (compiled) beside transformers, same checkpoint.

Random weights, built by transformers and written with ``save_pretrained`` (bf16, as real
checkpoints are) into a temporary folder, so that both sides load the same files and run them
in fp32 on the CPU. Two shapes:

- ``e2b``: Gemma 4 E2B's widths (hidden 1536; 8 query heads of 256, or 512 on full layers; 1
  key/value head; MLP 6144, doubled on KV-shared layers; per-layer embeddings of 256 per layer;
  vocabulary 262,144; window 512) with fewer layers: ``--layers`` (a multiple of 5, default 15)
  in blocks of [sliding x 4, full] like E2B's 35, with the same share KV-shared at block
  granularity (E2B: the last 20 of 35; 15 layers: the last 10).
- ``moe``: a small mixture-of-experts shape in the 26B-A4B layout (experts beside a dense MLP on
  every layer, k_eq_v full layers, no per-layer embeddings, no KV sharing): hidden 1024, 8
  layers, 64 experts of width 512 with 4 active, dense MLP 1024, vocabulary 32,768 (small, so
  that the output layer does not hide the experts).

Each side runs alone, one after the other (the other's model freed): gemma-engine compiled
with one bucket covering prompt + generation, a warm-up generation first (it compiles), then
``--repeats`` greedy generations; transformers with its defaults (sdpa attention, grouped_mm
experts, dynamic cache), timed as generate(N tokens) minus generate(1 token). Prints a Markdown
section (``--append`` adds it to BENCHMARKS.md). Not a test: run it on a quiet machine.

    .venv/bin/python scripts/bench_gemma4.py [--shapes e2b,moe] [--layers 15] [--tokens 64]
    .venv/bin/python scripts/bench_gemma4.py --tiny   # a tiny shape, a few tokens: does it run
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

from gemma_engine import Engine  # noqa: E402


def e2b_config(layers: int, tiny: bool):
    from transformers import Gemma4TextConfig

    if layers % 5 or layers < 10:
        raise SystemExit("--layers must be a multiple of 5, at least 10")
    blocks = layers // 5
    # E2B: 7 blocks, the last 4 (20 layers) KV-shared; keep that share, a whole block at least
    # producing (the shared layers read the last non-shared sliding and full layers).
    producing = max(1, round(blocks * 3 / 7))
    sizes = dict(
        vocab_size=262_144,
        hidden_size=1536,
        intermediate_size=6144,
        num_attention_heads=8,
        head_dim=256,
        global_head_dim=512,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262_144,
        sliding_window=512,
    )
    if tiny:
        sizes = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=512,
            sliding_window=16,
        )
    return Gemma4TextConfig(
        **sizes,
        num_hidden_layers=layers,
        num_key_value_heads=1,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * blocks,
        num_kv_shared_layers=layers - 5 * producing,
        use_double_wide_mlp=True,
        attention_k_eq_v=False,
        final_logit_softcapping=30.0,
        max_position_embeddings=131_072,
        tie_word_embeddings=True,
    )


def moe_config(tiny: bool):
    from transformers import Gemma4TextConfig

    sizes = dict(
        vocab_size=32_768,
        hidden_size=1024,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_global_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        num_experts=64,
        top_k_experts=4,
        moe_intermediate_size=512,
        sliding_window=1024,
    )
    if tiny:
        sizes = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_global_key_value_heads=1,
            head_dim=16,
            global_head_dim=32,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=32,
            sliding_window=16,
        )
    return Gemma4TextConfig(
        **sizes,
        num_hidden_layers=8,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"])
        + ["sliding_attention", "full_attention"],
        attention_k_eq_v=True,
        enable_moe_block=True,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        final_logit_softcapping=30.0,
        max_position_embeddings=262_144,
        tie_word_embeddings=True,
    )


def build_checkpoint(config, folder: Path) -> None:
    """Random weights by transformers' own init, saved in bf16 with a tiny tokenizer.json."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(bu.REPO / "tests"))
    from conftest import train_json_tokenizer  # the tests' Gemma-4-style tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()
    train_json_tokenizer(folder)


def params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            total += n
    return total


def time_engine(folder: Path, prompt: list[int], tokens: int, repeats: int) -> dict:
    ctx = len(prompt) + tokens
    load = time.perf_counter()
    engine = Engine.from_pretrained(
        folder, device="cpu", dtype="float32", compile=True, max_seq_len=ctx, buckets=[ctx]
    )
    load = time.perf_counter() - load
    warm = engine.generate(prompt, max_new_tokens=tokens)  # compiles the bucket's graph
    rates, other, out = [], bu.OtherLoad(), None
    for _ in range(repeats):
        out = engine.generate(prompt, max_new_tokens=tokens)
        rates.append(out.stats["decode_tokens_per_second"])
    return {
        "rate": bu.Summary.of(rates),
        "tokens": out.token_ids,
        "load_s": load,
        "compile_s": warm.stats["compile_seconds"],
        "prefill_s": out.stats["prefill_seconds"],
        "other_load": other.stop(),
    }


def time_transformers(folder: Path, prompt: list[int], tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    load = time.perf_counter() - load
    ids = torch.tensor([prompt])

    def generate(n: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    generate(tokens)  # warm-up
    rates, other, new = [], bu.OtherLoad(), []
    for _ in range(repeats):
        first, _ = generate(1)
        total, new = generate(tokens)
        rates.append((tokens - 1) / max(total - first, 1e-9))
    busy = other.stop()
    return {"rate": bu.Summary.of(rates), "tokens": new, "load_s": load, "other_load": busy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="e2b,moe", help="comma-separated: e2b, moe")
    p.add_argument("--layers", type=int, default=15, help="layers of the e2b shape (E2B: 35)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--prompt", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: check that the script runs")
    p.add_argument("--append", action="store_true", help="append the section to BENCHMARKS.md")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    info = bu.machine_info("cpu", torch.get_num_threads())
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    rows = []
    for shape in shapes:
        if shape == "e2b":
            config, label = e2b_config(args.layers, args.tiny), f"E2B-shaped, {args.layers} layers"
        elif shape == "moe":
            config = moe_config(args.tiny)
            label = f"small MoE ({config.num_experts} experts, top {config.top_k_experts})"
        else:
            raise SystemExit(f"unknown shape {shape!r}: use e2b or moe")
        if args.tiny:
            label += " (tiny)"
        with tempfile.TemporaryDirectory(prefix=f"bench-gemma4-{shape}-") as tmp:
            folder = Path(tmp)
            print(f"[{shape}] building the checkpoint in {folder} ...", file=sys.stderr)
            build_checkpoint(config, folder)
            n_params = params(folder)
            gen = torch.Generator().manual_seed(1)
            prompt = torch.randint(10, config.vocab_size, (args.prompt,), generator=gen).tolist()
            print(f"[{shape}] gemma-engine ...", file=sys.stderr)
            ours = time_engine(folder, prompt, args.tokens, args.repeats)
            torch._dynamo.reset()  # drop the graphs and with them the engine's weights
            gc.collect()
            print(f"[{shape}] transformers ...", file=sys.stderr)
            theirs = time_transformers(folder, prompt, args.tokens, args.repeats)
            gc.collect()
        same = 0
        for a, b in zip(ours["tokens"], theirs["tokens"], strict=False):
            if a != b:
                break
            same += 1
        busy = [x for x in (ours["other_load"], theirs["other_load"]) if x is not None]
        rows.append(
            [
                label,
                f"{n_params / 1e9:.2f} B" if n_params >= 1e8 else f"{n_params / 1e6:.2f} M",
                ours["rate"].fmt(1),
                theirs["rate"].fmt(1),
                f"{ours['rate'].median / theirs['rate'].median:.2f}x",
                f"{ours['compile_s']:.0f} s",
                f"{same}/{args.tokens}",
                f"{max(busy):.2f}" if busy else "n/a",
            ]
        )
    table = bu.md_table(
        [
            "shape",
            "parameters",
            "gemma-engine tok/s",
            "transformers tok/s",
            "ratio",
            "engine compile",
            "same greedy tokens",
            "other load (cores)",
        ],
        rows,
        align="llrrrrrr",
    )
    section = "\n".join(
        [
            f"## Gemma 4 decode on CPU ({info['date_utc']})",
            "",
            f"Machine: {bu.machine_line(info)}.  ",
            f"{bu.versions_line(info)}.  ",
            f"Command: `{bu.command_line()}`",
            "",
            f"fp32 weights (random, saved in bf16), greedy, a {args.prompt}-token prompt, "
            f"{args.tokens} new tokens; decode tokens/s as median (min-max) of "
            f"{args.repeats} runs. gemma-engine: compiled, one bucket of "
            f"{args.prompt + args.tokens}; transformers: its defaults (sdpa, grouped_mm "
            "experts, dynamic cache). 'same greedy tokens': the length of the common prefix "
            "(random weights give near-ties, where fp32 rounding may pick another token).",
            "",
            table,
            "",
        ]
    )
    print(section)
    if args.append:
        bu.append_section(bu.BENCHMARKS_MD, section)


if __name__ == "__main__":
    main()
