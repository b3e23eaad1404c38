"""The seed experiment: does reading the KV cache by buckets speed up decoding?

A Gemma-2b-shaped model (hidden 2048, 8 query heads, 1 KV head, head_dim 256, MLP 16384,
vocabulary 256000, 18 layers; random weights) decodes to total lengths 1024, 2048, 4096
and 8192 in two ways, side by side in one process, both compiled:

  full       Engine(max_seq_len=L, buckets=[L]): every step attends over all L slots of
             the static cache, as a plain static-cache implementation does;
  bucketed   the engine's default power-of-two buckets: a step at position p attends over
             the smallest bucket holding p + 1 positions.

The reference figures (gemma-2b on an A100, bf16) are speedups of 1.03x, 1.11x, 1.24x and
1.38x at those lengths.

Two ways to measure (--method):

  steps      (default on CPU, where generating 8192 tokens per run is too slow) the latency
             of single decode steps. A step's cost depends only on its bucket, because
             positions are tensors and masking is by position. For each length L: the full
             engine's step at L, and the bucketed engine's step in every bucket b <= L; the
             time to decode positions 0..L-1 is then sum over buckets of (positions in b) x
             (step time in b). Speedup = L x full step / that sum.
  generate   (default on CUDA) the real thing: engine.generate from a 1-token prompt to total
             length L, wall time, full vs bucketed. EOS is disabled for the run (random
             weights may emit it).

The bucketed contestant is one engine with max_seq_len = max(lengths): for a total length L
it uses exactly the buckets <= L that an engine with max_seq_len = L would have (the default
buckets are powers of two and so are the lengths), and a bucket's graph reads only its slice of
the cache, so the larger buffer costs nothing but memory; it saves compiling the same small
buckets once per length.

    python scripts/bench_buckets.py                       # CPU, 4 layers, steps
    python scripts/bench_buckets.py --layers 18 --device cuda --method generate
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _benchutil as bu  # noqa: E402

TEXT_CANDIDATES = [
    bu.REPO.parent / "shared" / "data" / "tinyshakespeare.txt",
    Path("/work/shared/data/tinyshakespeare.txt"),
]
REFERENCE = {1024: 1.03, 2048: 1.11, 4096: 1.24, 8192: 1.38}  # gemma-2b, A100
GEMMA_2B = {
    "model_type": "gemma",
    "architectures": ["GemmaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "num_hidden_layers": 18,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


# --------------------------------------------------------------------------- the model


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Gemma (1) causal LM."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def find_tokenizer(workdir: Path) -> Path:
    """A SentencePiece model for the folder (the engine requires one).

    Prompts here are token ids and the output text is never read, so any tokenizer does:
    the default model's, else a small one trained on the benchmark text.
    """
    try:
        from gemma_engine.gguf import ensure_default_model

        return ensure_default_model() / "tokenizer.model"
    except Exception as err:  # noqa: BLE001 - any failure: fall back to a trained one
        print(f"default model unavailable ({err}); training a small tokenizer", flush=True)
    import sentencepiece as spm

    prefix = workdir / "bench-tokenizer"
    if not prefix.with_suffix(".model").is_file():
        text = next(p for p in TEXT_CANDIDATES if p.is_file())
        workdir.mkdir(parents=True, exist_ok=True)
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(prefix), vocab_size=2000, model_type="bpe"
        )
    return prefix.with_suffix(".model")


def make_random_model(folder: Path, layers: int, dtype_name: str) -> Path:
    """A Gemma-2b-shaped folder with random weights (cached: rebuilt only when missing)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    cfg = dict(GEMMA_2B, num_hidden_layers=layers, torch_dtype=dtype_name)
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        if json.loads((folder / "config.json").read_text()) == cfg:
            return folder
    print(f"writing random Gemma-2b-shaped weights ({layers} layers) to {folder} ...", flush=True)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.zeros(shape, dtype=dtype)  # Gemma scales by (1 + w)
        else:
            tensors[name] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copyfile(find_tokenizer(folder.parent), tmp / "tokenizer.model")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


# --------------------------------------------------------------------------- measuring


def schedule(buckets: list[int], length: int) -> dict[int, int]:
    """Positions 0..length-1 counted by the bucket their decode step uses."""
    counts: dict[int, int] = {}
    lo = 0
    for b in buckets:
        if lo >= length:
            break
        hi = min(b, length)
        counts[b] = hi - lo
        lo = hi
    return counts


def time_steps(engine, pos: int, k: int, sync) -> float:
    """Mean seconds of k decode steps at position pos (greedy argmax included)."""
    import torch

    tok = torch.tensor([[7]], device=engine.device)
    input_pos = torch.tensor([pos], device=engine.device)
    kv_len = engine.bucket_for(pos + 1)
    with bu.Timer(sync) as t:
        for _ in range(k):
            engine.step(tok, input_pos, kv_len)[:, -1].argmax(-1).item()
    return t.seconds / k


def clean_rounds(one_round, lengths: list[int], args) -> tuple[list[dict], list[dict]]:
    """args.repeats rounds during which other processes stayed (almost) off the CPU.

    A round disturbed by other work (more than --quiet-threshold cores busy on average) is
    set aside and run again, up to as many extra rounds as requested; if the machine never
    quiets down, the disturbed rounds are used too and the report says so.
    """
    kept, discarded = [], []
    while len(kept) < args.repeats:
        if len(discarded) < args.repeats:
            bu.wait_for_quiet(args.max_wait, args.quiet_threshold)
        load = bu.OtherLoad()
        r = one_round()
        r["other_load_cores"] = load.stop()
        noisy = r["other_load_cores"] is not None and r["other_load_cores"] >= args.quiet_threshold
        tag = f"other load {r['other_load_cores'] or 0:.2f} cores"
        if noisy and len(discarded) < args.repeats:
            discarded.append(r)
            tag += ", set aside: measured again"
        else:
            kept.append(r)
        speeds = ", ".join(f"{L}: {r['speedup'][L]:.3f}x" for L in lengths)
        print(f"round {len(kept)}/{args.repeats}: {speeds} ({tag})", flush=True)
    return kept, discarded


def run_steps(full: dict, bucketed, lengths: list[int], args, sync) -> dict:
    """Per-step latencies in rounds (full and bucketed interleaved against drift)."""
    buckets = [b for b in bucketed.buckets if b <= max(lengths)]
    t0 = time.perf_counter()
    # Warm-up: compile every graph, then a few steps each.
    bu.wait_for_quiet(args.max_wait, args.quiet_threshold)
    compile_s = {}
    for L in lengths:
        with bu.Timer(sync) as t:
            time_steps(full[L], L - 1, 1, sync)
        compile_s[f"full-{L}"] = t.seconds
    for b in buckets:
        with bu.Timer(sync) as t:
            time_steps(bucketed, b - 1, 1, sync)
        compile_s[f"bucket-{b}"] = t.seconds
    for L in lengths:
        time_steps(full[L], L - 1, 2, sync)
    for b in buckets:
        time_steps(bucketed, b - 1, 2, sync)
    print(f"warm-up (compiles) {time.perf_counter() - t0:.0f} s", flush=True)
    # Check, once, that a step's cost depends on its bucket and not on its position: the
    # full engine early in its buffer and at its end.
    early_pos = lengths[0] // 4
    check = {
        L: {
            "early": time_steps(full[L], early_pos, args.steps, sync),
            "last": time_steps(full[L], L - 1, args.steps, sync),
        }
        for L in lengths
    }

    figures = [("full", L) for L in lengths] + [("bucket", b) for b in buckets]

    def one_round() -> dict:
        # Steps of all figures interleaved (in a rotating order), so that slow drifts of the
        # machine's speed hit every figure alike instead of biasing one side of a ratio.
        samples: dict[tuple[str, int], list[float]] = {f: [] for f in figures}
        for s in range(args.steps):
            k = s % len(figures)
            for kind, n in figures[k:] + figures[:k]:
                engine = full[n] if kind == "full" else bucketed
                samples[(kind, n)].append(time_steps(engine, n - 1, 1, sync))
        full_s = {L: statistics.fmean(samples[("full", L)]) for L in lengths}
        bucket_s = {b: statistics.fmean(samples[("bucket", b)]) for b in buckets}
        speed, same, control = {}, {}, {}
        for L in lengths:
            counts = schedule(buckets, L)
            total_b = sum(n * bucket_s[b] for b, n in counts.items())
            speed[L] = L * full_s[L] / total_b
            # The bucketed engine's own graph for bucket L does the full-buffer step's work
            # (attention over L slots): the same ratio without comparing two engine objects.
            same[L] = L * bucket_s[L] / total_b
            # Same work in both engines: any departure from 1 is the instrument's error.
            control[L] = full_s[L] / bucket_s[L]
        return {
            "full": full_s,
            "bucket": bucket_s,
            "speedup": speed,
            "speedup_same_engine": same,
            "control": control,
        }

    rounds, discarded = clean_rounds(one_round, lengths, args)
    out = {"compile_s": compile_s, "buckets": buckets, "rounds": rounds, "discarded": discarded}
    out["speedup"] = {
        L: bu.Summary.of([r["speedup"][L] for r in rounds]).as_dict() for L in lengths
    }
    for key in ("speedup_same_engine", "control"):
        out[key] = {L: bu.Summary.of([r[key][L] for r in rounds]).as_dict() for L in lengths}
    out["full_step_s"] = {
        L: bu.Summary.of([r["full"][L] for r in rounds]).as_dict() for L in lengths
    }
    out["position_check"] = {"early_position": early_pos, "seconds": check}
    out["bucket_step_s"] = {
        b: bu.Summary.of([r["bucket"][b] for r in rounds]).as_dict() for b in buckets
    }
    return out


def run_generate(full: dict, bucketed, lengths: list[int], args, sync) -> dict:
    """Wall time of engine.generate to each total length, full vs bucketed."""
    prompt = [2]

    def gen(engine, L):
        with bu.Timer(sync) as t:
            g = engine.generate(prompt, max_new_tokens=L - len(prompt))
        assert len(g.token_ids) == L - len(prompt), "generation stopped early"
        return t.seconds

    t0 = time.perf_counter()
    compile_s = {}
    for L in lengths:
        compile_s[f"full-{L}"] = gen(full[L], L)
    compile_s["bucketed"] = gen(bucketed, max(lengths))
    print(f"warm-up (compiles) {time.perf_counter() - t0:.0f} s", flush=True)

    def one_round() -> dict:
        full_s = {L: gen(full[L], L) for L in lengths}
        buck_s = {L: gen(bucketed, L) for L in lengths}
        speed = {L: full_s[L] / buck_s[L] for L in lengths}
        return {"full": full_s, "bucketed": buck_s, "speedup": speed}

    rounds, discarded = clean_rounds(one_round, lengths, args)
    out = {"compile_s": compile_s, "buckets": list(bucketed.buckets), "rounds": rounds}
    out["discarded"] = discarded
    out["speedup"] = {
        L: bu.Summary.of([r["speedup"][L] for r in rounds]).as_dict() for L in lengths
    }
    out["full_tok_s"] = {
        L: bu.Summary.of([(L - 1) / r["full"][L] for r in rounds]).as_dict() for L in lengths
    }
    out["bucketed_tok_s"] = {
        L: bu.Summary.of([(L - 1) / r["bucketed"][L] for r in rounds]).as_dict() for L in lengths
    }
    return out


# --------------------------------------------------------------------------- report


def render(run: dict, args) -> str:
    m = run["machine"]
    res = run["result"]
    lengths = run["lengths"]
    steps_n = run.get("steps", args.steps)
    repeats = run.get("repeats", args.repeats)
    threshold = run.get("quiet_threshold", args.quiet_threshold)
    L = [f"## KV bucketing speedup (seed experiment), {m['device']}, {m['date_utc']}", ""]
    L.append(f"- Command: `{run['command']}` (total {run['total_s'] / 60:.1f} min)")
    L.append(f"- Machine: {bu.machine_line(m)}")
    L.append(f"- Versions: {bu.versions_line(m)}")
    layers = run["layers"]
    L.append(
        f"- Model: Gemma-2b-shaped (hidden 2048, 8 heads, 1 KV head, head_dim 256, MLP "
        f"16384, vocab 256000), random weights, **{layers} layers**"
        + ("" if layers == 18 else " (gemma-2b has 18; fewer to fit the time budget)")
        + f', {run["dtype"]}, compiled (`torch.compile(mode="reduce-overhead", '
        f"fullgraph=True, dynamic=False)`), batch 1."
    )
    if run["method"] == "steps":
        L.append(
            "- Measured: **single decode-step latency, not a full generation.** Full: the "
            "engine with `max_seq_len=L, buckets=[L]`, a step at position L-1. Bucketed: the "
            "default buckets " + ", ".join(str(b) for b in res["buckets"]) + ", a step at the "
            "last position of each bucket. Decoding positions 0..L-1 is then L x (full step) "
            "against the sum over buckets of (positions in the bucket) x (its step). Each "
            f"step figure is the mean of {steps_n} steps, the steps of all figures "
            "interleaved; speedups are the median (min-max) of the per-round speedups of "
            f"{repeats} rounds."
        )
    else:
        L.append(
            "- Measured: wall time of `engine.generate` from a 1-token prompt to total length L "
            f"(EOS disabled), full vs bucketed, median (min-max) of {repeats} rounds."
        )
    L.append("")
    steps = run["method"] == "steps"
    heads = ["total length", "speedup (this run)"]
    if steps:
        heads += ["same-engine speedup", "control (should be 1)"]
    heads += ["bytes model", "reference (gemma-2b, A100)"]
    rows = []

    def cell(key: str, n: int) -> str:
        s = bu.summary_from_dict(res[key][str(n)])
        return f"{s.median:.3f}x ({s.min:.3f}-{s.max:.3f})"

    for n in lengths:
        ref = REFERENCE.get(n)
        row = [str(n), cell("speedup", n)]
        if steps:
            row += [cell("speedup_same_engine", n), cell("control", n).replace("x", "")]
        row += [f"{run['bytes_model'][str(n)]:.3f}x", f"{ref:.2f}x" if ref else "-"]
        rows.append(row)
    L.append(bu.md_table(heads, rows))
    L.append("")
    if steps:
        L.append(
            "*Speedup*: the full engines (`buckets=[L]`) against the bucketed engine, as "
            "specified. *Same-engine speedup*: the bucketed engine's own bucket-L graph, which "
            "attends over L slots just as the full engine does, stands in for the full step, "
            "so one engine object provides both sides. *Control*: full engine's step / the "
            "bucketed engine's bucket-L step, the same work in two engine objects; how far it "
            "is from 1 shows how much of a speedup figure this instrument can attribute to "
            "bucketing."
        )
        L.append("")
    bm = run["bytes_model_inputs"]
    L.append(
        "*Bytes model* is not a measurement: it is the speedup if every decode step were "
        f"limited only by the bytes it reads, weights ({bm['weight_bytes'] / 1e9:.2f} GB) plus "
        f"keys and values ({bm['kv_bytes_per_position'] / 1e3:.0f} kB per position) over the "
        "slots it attends, summed over the same schedule. Where the "
        "measurement is above it, bucketing saves more than memory traffic (e.g. attention "
        "compute or kernel overhead over the unused slots); where a weight read dominates, the "
        "effect is bounded by it."
    )
    L.append("")
    if run["method"] == "steps":
        rows = []
        chk = res["position_check"]
        for n in lengths:
            f = bu.summary_from_dict(res["full_step_s"][str(n)])
            c = chk["seconds"][str(n)]
            rows.append(
                [
                    f"full, L = {n}",
                    f"{1e3 * f.median:.1f} ({1e3 * f.min:.1f}-{1e3 * f.max:.1f})",
                    f"{1e3 * c['early']:.1f} / {1e3 * c['last']:.1f}",
                ]
            )
        for b in res["buckets"]:
            s = bu.summary_from_dict(res["bucket_step_s"][str(b)])
            rows.append(
                [
                    f"bucketed, bucket {b}",
                    f"{1e3 * s.median:.1f} ({1e3 * s.min:.1f}-{1e3 * s.max:.1f})",
                    "",
                ]
            )
        L.append(
            "Step latencies, ms (median (min-max) over rounds). The last column checks, once "
            "after warm-up, that a step costs the same anywhere in its bucket: the full engine "
            f"at position {chk['early_position']} / at position L-1, measured back to back:"
        )
        L.append("")
        L.append(
            bu.md_table(
                [
                    "decode step",
                    "ms (last position of the bucket)",
                    f"ms at {chk['early_position']} / L-1",
                ],
                rows,
            )
        )
        L.append("")
    kept = [r["other_load_cores"] for r in res["rounds"] if r.get("other_load_cores") is not None]
    if kept:
        L.append(
            f"Other processes on the machine used at most {max(kept):.2f} CPU cores on average "
            f"during a kept round; {len(res.get('discarded', []))} round(s) disturbed by other "
            f"work (>= {threshold} cores) were set aside and measured again."
        )
        L.append("")
    comp = ", ".join(f"{k} {v:.0f} s" for k, v in res["compile_s"].items())
    L.append(
        f"First calls (compile + one step; TorchInductor's on-disk cache may hold kernels "
        f"from an earlier run): {comp}."
    )
    L.append("")
    L.append(
        f"Plot: [bucketing speedup vs length]({bu.rel(plot_path(run, args), args.out.parent)})."
    )
    return "\n".join(L) + "\n"


def plot_path(run: dict, args) -> Path:
    tag = "cuda" if run["machine"]["device"].startswith("cuda") else "cpu"
    return args.docs / f"buckets_speedup_{tag}.png"


def plot(run: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = run["lengths"]
    res = run["result"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    series = [("speedup", "")]
    if "speedup_same_engine" in res:
        series.append(("speedup_same_engine", ", same engine"))
    for key, suffix in series:
        s = [bu.summary_from_dict(res[key][str(n)]) for n in lengths]
        ax.errorbar(
            lengths,
            [x.median for x in s],
            yerr=[[x.median - x.min for x in s], [x.max - x.median for x in s]],
            marker="o",
            capsize=3,
            label=f"this run: {run['layers']} layers, {run['dtype']}, "
            f"{run['machine']['device']} ({run['method']}{suffix})",
        )
    ax.plot(
        lengths,
        [run["bytes_model"][str(n)] for n in lengths],
        ":",
        color="tab:green",
        label="bytes model (not measured: weight + KV bytes per step)",
    )
    ref = [n for n in lengths if n in REFERENCE]
    ax.plot(
        ref, [REFERENCE[n] for n in ref], "s--", color="gray", label="reference: gemma-2b, A100"
    )
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("total length L (static cache of L positions)")
    ax.set_ylabel("speedup of bucketed over full-buffer decode")
    ax.set_title("KV-cache bucketing, Gemma-2b shape")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    bu.save_figure(fig, plot_path(run, args))
    plt.close(fig)


# --------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--layers", type=int, default=None, help="default: 18, as gemma-2b")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--repeats", type=int, default=7, help="rounds; the speedup is their median")
    p.add_argument(
        "--steps", type=int, default=5, help="steps per figure and round (--method steps)"
    )
    p.add_argument(
        "--method",
        choices=["steps", "generate"],
        default=None,
        help="default: steps on CPU, generate on CUDA",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--max-wait",
        type=float,
        default=120,
        help="before each round, wait up to this many seconds for other processes to go quiet",
    )
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.25,
        help="a round during which other processes used more cores than this is repeated",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path.home() / ".cache" / "gemma-engine-bench",
        help="where the random-weights model folder is kept",
    )
    p.add_argument("--out", type=Path, default=bu.BENCHMARKS_MD)
    p.add_argument("--docs", type=Path, default=bu.DOCS)
    p.add_argument("--no-report", action="store_true", help="print only; write no files")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.layers = args.layers or 18
    args.method = args.method or ("generate" if cuda else "steps")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    t_run = time.perf_counter()
    lengths = sorted({int(x) for x in args.lengths.split(",") if x})
    info = bu.machine_info(args.device, args.threads)
    print(f"machine: {bu.machine_line(info)}\nversions: {bu.versions_line(info)}", flush=True)
    folder = make_random_model(
        args.workdir / f"gemma-2b-shape-{args.layers}l-{args.dtype}", args.layers, args.dtype
    )
    from gemma_engine import Engine

    sync = bu.cuda_sync_for(args.device)
    kw = {"device": args.device, "dtype": args.dtype, "compile": True, "max_batch": 1}
    full = {
        L: Engine.from_pretrained(str(folder), max_seq_len=L, buckets=[L], **kw) for L in lengths
    }
    bucketed = Engine.from_pretrained(str(folder), max_seq_len=max(lengths), **kw)
    for e in [*full.values(), bucketed]:
        e.eos_token_ids = set()  # random weights: never stop early (benchmark-only override)
    print(f"bucketed engine buckets: {bucketed.buckets}", flush=True)
    with torch.no_grad():
        if args.method == "steps":
            result = run_steps(full, bucketed, lengths, args, sync)
        else:
            result = run_generate(full, bucketed, lengths, args, sync)
    weight_bytes = sum(p.numel() * p.element_size() for p in bucketed.model.parameters())
    cfg = bucketed.config
    elem = next(bucketed.model.parameters()).element_size()
    kv_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
    bytes_model = {}
    for n in lengths:
        counts = schedule([b for b in bucketed.buckets if b <= max(lengths)], n)
        bucketed_bytes = sum(k * (weight_bytes + kv_pos * b) for b, k in counts.items())
        bytes_model[n] = n * (weight_bytes + kv_pos * n) / bucketed_bytes
    result = json.loads(json.dumps(result))  # int keys -> str, as they are stored
    run = {
        "machine": info,
        "command": bu.command_line(argv),
        "layers": args.layers,
        "dtype": args.dtype,
        "method": args.method,
        "steps": args.steps,
        "repeats": args.repeats,
        "quiet_threshold": args.quiet_threshold,
        "lengths": lengths,
        "reference": REFERENCE,
        "bytes_model": {str(n): v for n, v in bytes_model.items()},
        "bytes_model_inputs": {"weight_bytes": weight_bytes, "kv_bytes_per_position": kv_pos},
        "result": result,
        "total_s": time.perf_counter() - t_run,
    }
    section = render(run, args)
    print("\n" + section)
    if not args.no_report:
        tag = "cuda" if args.device.startswith("cuda") else "cpu"
        bu.atomic_write_json(args.docs / f"buckets_{tag}.json", run)
        plot(run, args)
        bu.append_section(args.out, section)
        print(f"wrote {args.out}, {args.docs}/buckets_{tag}.json and the plot", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
