"""Tensor parallelism: decode tokens/s of N processes (torchrun) against one, on the default
model. Not a test: run it on a quiet machine.

On CPU (gloo) N processes x 1 thread run against 1 process x N threads, the same cores; on
CUDA (``--device cuda``, NCCL) N GPUs against one.

Each layout runs in fresh processes (``--rounds`` times, alternating), and each process loads
the engine (compiled, one kv bucket covering prompt + generation, batch 1), compiles with a
warm-up generation, then times ``--repeats`` greedy generations of ``--tokens`` new tokens
from a random ``--prompt-len``-token prompt (the engine's own decode tokens/s; EOS may end a
run early, which the step count shows). Reported: the median (min-max) over all runs of a
layout, and for the parallel layout what one collective costs: the median time of an
all-reduce of one hidden state and of the logits' all-gather, and the collectives of a step
(two all-reduces per layer, one for the embedding, the gather, the token broadcast).

    .venv/bin/python scripts/bench_tp.py [--processes 2] [--weights float] [--rounds 3] [--append]
    .venv/bin/python scripts/bench_tp.py --device cuda --processes 4 --append  # 4 GPUs
    .venv/bin/python scripts/bench_tp.py --model tests-tiny-folder --no-compile --tokens 4 \\
        --repeats 1 --rounds 1    # seconds: does it run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402


def layouts(device: str, n: int) -> dict[str, tuple[int, int]]:
    """name: (processes, threads per process)."""
    if device.startswith("cuda"):
        return {"1 GPU": (1, 1), f"{n} GPUs": (n, 1)}
    return {f"1 process x {n} threads": (1, n), f"{n} processes x 1 thread": (n, 1)}


# ============================================================================ worker
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from gemma_engine import Engine
    from gemma_engine.gguf import ensure_default_model

    torch.set_num_threads(args.threads)
    model = args.model or str(ensure_default_model())
    bucket = args.prompt_len + args.tokens + 1
    engine = Engine.from_pretrained(
        model,
        device=args.device,
        compile=not args.no_compile,
        max_batch=1,
        buckets=[bucket],
        max_seq_len=bucket,
        quantize=args.weights if args.weights != "float" else None,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size
    prompt = [
        2,
        *torch.randint(
            min(1000, vocab // 2), vocab, (args.prompt_len - 1,), generator=gen
        ).tolist(),
    ]
    engine.generate(prompt, max_new_tokens=4)  # compiles the bucket's graph
    rates, steps = [], []
    for _ in range(args.repeats):
        out = engine.generate(prompt, max_new_tokens=args.tokens)
        rates.append(out.stats["decode_tokens_per_second"] or 0.0)
        steps.append(out.stats["decode_tokens"])
    result = {
        "rates": rates,
        "steps": steps,
        "tokens": out.token_ids,
        "peak_rss_bytes": bu.peak_rss_bytes(),  # rank 0's
    }
    tp = engine.model.tp
    if tp is not None:
        result["collectives"] = collective_costs(engine, tp)
    if tp is None or tp.ranks.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_costs(engine, tp, repeats: int = 200) -> dict:
    """Median seconds of the collectives one decode step makes, timed alone (eager)."""
    import torch
    import torch.distributed as dist

    cfg = engine.config
    device = engine.device
    hidden = torch.randn(
        1, 1, cfg.hidden_size, device=device, dtype=engine.model.model.norm.weight.dtype
    )
    logits = torch.randn(1, 1, tp.vocab, device=device)

    def timed(fn) -> float:
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    reduce_s = timed(lambda: tp.reduce(hidden) + 0)  # any use waits for the collective
    gather_s = timed(lambda: tp.gather_vocab(logits) + 0)
    token = torch.zeros(1, dtype=torch.long, device=device)
    broadcast_s = timed(lambda: tp.broadcast(token))
    per_step = 2 * cfg.num_hidden_layers + 1
    return {
        "all_reduce_s": reduce_s,
        "all_gather_s": gather_s,
        "broadcast_s": broadcast_s,
        "all_reduces_per_step": per_step,
        "step_s": per_step * reduce_s + gather_s + broadcast_s,
    }


# ============================================================================ orchestrator
def run_layout(args: argparse.Namespace, processes: int, threads: int, out: Path) -> dict:
    script = str(Path(__file__).resolve())
    worker_args = [
        "--worker",
        "--threads",
        str(threads),
        "--out",
        str(out),
        "--weights",
        args.weights,
        "--device",
        args.device,
        "--tokens",
        str(args.tokens),
        "--prompt-len",
        str(args.prompt_len),
        "--repeats",
        str(args.repeats),
    ]
    if args.model:
        worker_args += ["--model", args.model]
    if args.no_compile:
        worker_args.append("--no-compile")
    if processes == 1:
        command = [sys.executable, script, *worker_args]
    else:
        launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
        command = [sys.executable, *launch, script, *worker_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(bu.REPO)}
    load = bu.OtherLoad()
    subprocess.run(command, check=True, env=env, cwd=bu.REPO)
    result = json.loads(out.read_text())
    result["other_load"] = load.stop()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: Gemma 3 270M")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--processes", type=int, default=2, help="ranks of the parallel layout")
    p.add_argument("--weights", choices=["float", "int8"], default="float")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed generations per process")
    p.add_argument("--rounds", type=int, default=3, help="processes per layout, alternating")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--max-wait", type=float, default=600, help="seconds to wait for quiet")
    p.add_argument("--append", action="store_true", help="append the section to BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    info = bu.machine_info(args.device, None)
    plan = layouts(args.device, args.processes)
    print(f"machine: {bu.machine_line(info)}\nversions: {bu.versions_line(info)}", flush=True)
    if args.device == "cpu":
        bu.wait_for_quiet(args.max_wait)
    results: dict[str, list[dict]] = {name: [] for name in plan}
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        for r in range(args.rounds):
            for name, (processes, threads) in plan.items():
                print(f"[round {r + 1}/{args.rounds}] {name} ...", file=sys.stderr, flush=True)
                out = Path(tmp) / f"{processes}x{threads}-{r}.json"
                results[name].append(run_layout(args, processes, threads, out))
    rows = []
    for name, runs in results.items():
        rates = bu.Summary.of([x for run in runs for x in run["rates"]])
        steps = sorted({s for run in runs for s in run["steps"]})
        busy = [run["other_load"] for run in runs if run["other_load"] is not None]
        rss = max(run["peak_rss_bytes"] for run in runs)
        comm = [run["collectives"] for run in runs if "collectives" in run]
        cost = "-"
        if comm:
            step_ms = statistics.median(c["step_s"] for c in comm) * 1e3
            reduce_us = statistics.median(c["all_reduce_s"] for c in comm) * 1e6
            gather_us = statistics.median(c["all_gather_s"] for c in comm) * 1e6
            cost = (
                f"{step_ms:.2f} ms ({comm[0]['all_reduces_per_step']} x {reduce_us:.0f} us "
                f"all-reduce, {gather_us:.0f} us gather)"
            )
        rows.append(
            [
                name,
                rates.fmt(1),
                f"{1e3 / rates.median:.1f}",
                ", ".join(map(str, steps)),
                bu.fmt_bytes(rss),
                cost,
                f"{max(busy):.2f}" if busy else "n/a",
            ]
        )
    same = len({tuple(run["tokens"]) for runs in results.values() for run in runs}) == 1
    table = bu.md_table(
        [
            "layout",
            "decode tok/s",
            "ms/token",
            "steps timed",
            "peak RSS per process",
            "collectives per step (timed alone)",
            "other load (cores)",
        ],
        rows,
        align="lrrrrll",
    )
    model = args.model or "Gemma 3 270M (default)"
    section = "\n".join(
        [
            f"## Tensor parallelism on CPU ({info['date_utc']})",
            "",
            f"Machine: {bu.machine_line(info)}.  ",
            f"{bu.versions_line(info)}.  ",
            f"Command: `{bu.command_line()}`",
            "",
            f"{model}, {args.weights} weights ({'fp32' if args.device == 'cpu' else 'bf16'}), "
            f"{args.device}, {'eager' if args.no_compile else 'compiled'}, "
            f"batch 1, greedy, a {args.prompt_len}-token prompt, {args.tokens} new tokens; "
            f"decode tokens/s as median (min-max) of {args.rounds} processes x {args.repeats} "
            f"generations per layout. {args.processes} processes: torchrun "
            f"({'gloo' if args.device == 'cpu' else 'NCCL'}), each rank holding its share of "
            "the heads, MLP columns and vocabulary (parallel.py). Same tokens in every run: "
            f"{'yes' if same else 'no'}.",
            "",
            table,
            "",
        ]
    )
    print(section)
    if args.json:
        bu.atomic_write_json(args.json, {"machine": info, "results": results})
    if args.append:
        bu.append_section(bu.BENCHMARKS_MD, section)


if __name__ == "__main__":
    main()
