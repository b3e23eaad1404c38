"""Decode speed of contestants measured in alternating rounds, for ratios a noisy machine's drift
cannot decide.

    .venv/bin/python scripts/bench_rounds.py [--contestants engine-int8,llama.cpp]
        [--contexts 128,1024,4096] [--rounds 15] [--steps 20] [--capability avx2]
        [--llama-cpp-path .llama/avx2] [--fresh-cache] [--docs docs/NAME]

bench.py runs each contestant in its own process, one after another, so two contestants'
figures are minutes apart; on a shared VM whose speed drifts by 30% or more within minutes
that gap, not the code, can decide their ratio. Here every contestant (bench.py's, the same
classes) is a worker process that loads, compiles and warms up once, one worker at a time,
and then sleeps until asked. For each context, each round times ``--steps`` decode steps of
every contestant in turn (the order reversed every other round) and one read-bandwidth probe,
so each round compares the contestants a few seconds apart.

Reported per contestant and context: tokens/s from the median step over all rounds, its
share of the bandwidth bound (bytes read per token over the median bandwidth probe of the
same context's rounds, the figure issue #9 names), and against the reference contestant
(``--reference``, default the last one) the ratio of medians with the range of the
per-round ratios. Engine workers use the engine's own cache folder ($GEMMA_ENGINE_CACHE or
its default), so graphs an earlier run compiled load in seconds; ``--fresh-cache`` gives them
an empty one. The report is printed and, with ``--docs``, written there as rounds.md and
rounds.json.

A second table splits each context's rounds by their bandwidth probe, at its median: a VM
whose memory is sometimes fast and sometimes slow shows there whether a contestant follows
the memory (bandwidth-bound: shorter steps in fast rounds) or not (bound by its own
arithmetic). ``--from docs/NAME/rounds.json`` prints the report of a saved run again, this
table included, without measuring anything.
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
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402
import bench  # noqa: E402

READY = "@@ready "  # prefix of the worker's protocol lines on its stdout
REPLY = "@@reply "


# ============================================================================ worker


def worker(name: str, spec: dict) -> None:
    """Load, warm up every context, then answer {"ctx", "steps"} requests from stdin."""
    if not name.startswith("llama.cpp"):
        import torch

        torch.set_num_threads(spec["threads"])
        torch.set_grad_enabled(False)
    c = bench.make_contestant(name, spec)
    t = time.perf_counter()
    c.load()
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    for ctx in spec["contexts"]:  # compiles (or loads) every graph the rounds use
        c.prepare(ctx)
        for _ in range(3):
            c.decode_step(ctx)
    ready = {"load_s": load_s, "warmup_s": time.perf_counter() - t}
    print(READY + json.dumps(ready), flush=True)
    prepared = None
    for line in sys.stdin:
        request = json.loads(line)
        ctx = request["ctx"]
        if ctx != prepared:
            c.prepare(ctx)
            prepared = ctx
        c.decode_step(ctx)  # untimed: the other contestant ran last and evicted the caches
        times = []
        for _ in range(request["steps"]):
            start = time.perf_counter()
            c.decode_step(ctx)
            times.append(time.perf_counter() - start)
        print(REPLY + json.dumps({"times": times, "read_bytes": c.read_bytes(ctx)}), flush=True)


class Worker:
    """One contestant's process, driven through its stdin and stdout."""

    def __init__(self, name: str, spec_path: Path, args, log_dir: Path) -> None:
        self.name = name
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(args.threads)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bu.REPO), env.get("PYTHONPATH")]))
        if args.fresh_cache:
            env["GEMMA_ENGINE_CACHE"] = str(log_dir / f"cache-{name}")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name]
        cmd += ["--worker-spec", str(spec_path)]
        self.log = log_dir / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=bu.REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, text=True, bufsize=1,
            )  # fmt: skip

    def _read(self, prefix: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return json.loads(line[len(prefix) :])
        tail = self.log.read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"{self.name} exited ({self.proc.wait()}):\n  " + "\n  ".join(tail))

    def ready(self) -> dict:
        return self._read(READY)

    def measure(self, ctx: int, steps: int) -> dict:
        self.proc.stdin.write(json.dumps({"ctx": ctx, "steps": steps}) + "\n")
        return self._read(REPLY)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ============================================================================ orchestrator


def read_bandwidth(buffer, probes: int = 3) -> float:
    """Read GB/s: the median of ``probes`` sums over a buffer larger than any cache."""
    rates = []
    for _ in range(probes):
        start = time.perf_counter()
        buffer.sum()
        rates.append(buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def run_rounds(workers: dict[str, Worker], args, contexts: list[int]) -> dict:
    import torch

    buffer = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    buffer.sum()  # page faults, outside the probes
    results: dict = {"contexts": {}}
    names = list(workers)
    for ctx in contexts:
        rounds, bandwidth, read_bytes = [], [], {}
        start = time.time()
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            this = {}
            for name in order:
                reply = workers[name].measure(ctx, args.steps)
                this[name] = reply["times"]
                read_bytes[name] = reply["read_bytes"]
            bandwidth.append(read_bandwidth(buffer))
            rounds.append(this)
        results["contexts"][str(ctx)] = {
            "rounds": rounds,
            "bandwidth_gbs": bandwidth,
            "read_bytes": read_bytes,
            "seconds": time.time() - start,
        }
        line = ", ".join(
            f"{n} {1 / statistics.median([t for rd in rounds for t in rd[n]]):.1f} tok/s"
            for n in names
        )
        print(f"ctx {ctx}: {line}; read {statistics.median(bandwidth):.1f} GB/s", flush=True)
    return results


def report(results: dict, names: list[str], reference: str, info: dict, args) -> str:
    rows = []
    for ctx, data in results["contexts"].items():
        bw = statistics.median(data["bandwidth_gbs"]) * 1e9
        median = {n: statistics.median([t for rd in data["rounds"] for t in rd[n]]) for n in names}
        for n in names:
            bound = data["read_bytes"][n] / bw / median[n]
            if n == reference:
                ratio = spread = "(reference)"
            else:
                per_round = [
                    statistics.median(rd[reference]) / statistics.median(rd[n])
                    for rd in data["rounds"]
                ]
                ratio = f"**{median[reference] / median[n]:.2f}x**"
                spread = f"{min(per_round):.2f}-{max(per_round):.2f}x"
            rows.append(
                [
                    bu.fmt_ctx(int(ctx)), n, f"{1 / median[n]:.1f}",
                    f"{median[n] * 1e3:.2f}", f"{bound:.0%}", ratio, spread,
                ]
            )  # fmt: skip
    bws = ", ".join(
        f"{bu.fmt_ctx(int(c))} {min(d['bandwidth_gbs']):.1f}-{max(d['bandwidth_gbs']):.1f}"
        for c, d in results["contexts"].items()
    )
    halves = by_probe(results, names, reference)
    table = bu.md_table(
        ["context", "contestant", "tok/s", "median step ms", "of bound",
         f"vs {reference}", "per-round ratio"],
        rows,
        "llrrrrr",
    )  # fmt: skip
    return "\n".join(
        [
            f"### Alternating rounds, {info['date_utc']}",
            "",
            f"Command: `{results.get('command') or 'see rounds.md beside the saved run'}`"
            + ("" if not args.saved else f"; reported again by `{bu.command_line()}`"),
            "",
            f"Machine: {bu.machine_line(info)}",
            f"Versions: {bu.versions_line(info)}"
            + (f"; llama.cpp {info['llama_cpp_build']}" if "llama_cpp_build" in info else ""),
            "",
            f"{args.rounds} rounds of {args.steps} decode steps per contestant and context, "
            "the order reversed every other round; tok/s from the median step of all rounds; "
            "of bound: bytes read per token / the median read bandwidth of that context's "
            f"rounds (GB/s per context, min-max of the probes: {bws}).",
            "",
            table,
            "",
            "The same rounds split at each context's median probe: slower-memory rounds "
            "(probe at or below the median) and faster ones; per half the median probe, each "
            "contestant's median step, the bytes it reads per token over that step (GB/s), "
            f"that over the half's probe, and the ratio of medians against {reference}.",
            "",
            halves,
            "",
        ]
    )


def by_probe(results: dict, names: list[str], reference: str) -> str:
    """The report's second table: each context's rounds in two halves by their probe."""
    rows = []
    for ctx, data in results["contexts"].items():
        probes = data["bandwidth_gbs"]
        cut = statistics.median(probes)
        for label, faster in (("slower", False), ("faster", True)):
            keep = [(b > cut) == faster for b in probes]
            picked = [rd for rd, k in zip(data["rounds"], keep, strict=True) if k]
            if not picked:
                continue
            probe = statistics.median([b for b, k in zip(probes, keep, strict=True) if k])
            median = {n: statistics.median([t for rd in picked for t in rd[n]]) for n in names}
            for n in names:
                rate = data["read_bytes"][n] / median[n] / 1e9
                ratio = "(reference)" if n == reference else f"{median[reference] / median[n]:.2f}x"
                rows.append(
                    [
                        bu.fmt_ctx(int(ctx)), f"{label} ({len(picked)})", f"{probe:.1f}", n,
                        f"{median[n] * 1e3:.2f}", f"{rate:.1f}", f"{rate / probe:.0%}", ratio,
                    ]
                )  # fmt: skip
    return bu.md_table(
        ["context", "rounds", "probe GB/s", "contestant", "median step ms", "read GB/s",
         "of probe", f"vs {reference}"],
        rows,
        "llrlrrrr",
    )  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contestants", default="engine-int8,llama.cpp")
    p.add_argument("--reference", default=None, help="default: the last contestant")
    p.add_argument("--contexts", default="128,1024,4096")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, default=None, help="default: the default model")
    p.add_argument("--gguf", default=None, help="llama.cpp's model; default: the default GGUF")
    p.add_argument("--capability", choices=["native", "avx2"], default="native")
    p.add_argument("--llama-cpp-path", default=None)
    p.add_argument("--fresh-cache", action="store_true", help="engine: an empty compile cache")
    p.add_argument("--docs", type=Path, default=None, help="folder for rounds.md and .json")
    p.add_argument("--from", dest="saved", type=Path, help="report a saved rounds.json again")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        try:
            worker(args.worker, json.loads(Path(args.worker_spec).read_text()))
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    if args.saved:  # no measuring: the saved run's report, with its own settings
        results = json.loads(args.saved.read_text())
        args.steps = len(next(iter(results["contexts"].values()))["rounds"][0][results["names"][0]])
        args.rounds = results["rounds"]
        print(report(results, results["names"], results["reference"], results["info"], args))
        return 0
    bu.reexec_lowered(args.capability, args.llama_cpp_path)
    import torch

    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.contestants.split(",") if n.strip()]
    for n in names:
        if n not in bench.CONTESTANTS:
            known = ", ".join(bench.CONTESTANTS)
            raise SystemExit(f"unknown contestant {n!r}; choose from {known}")
    reference = args.reference or names[-1]
    if reference not in names or len(names) < 2:
        raise SystemExit("give at least two contestants, the reference among them")
    contexts = sorted({int(x) for x in args.contexts.split(",") if x})
    info = bu.machine_info("cpu", args.threads)
    gguf = args.gguf
    if any(n.startswith("llama.cpp") for n in names):
        info["llama_cpp_build"] = bu.llama_cpp_build()
        if args.capability == "avx2" and "AVX512" in info["llama_cpp_build"].split("(")[-1]:
            raise SystemExit(
                "an AVX2 run needs an AVX2-only llama.cpp: --llama-cpp-path .llama/avx2"
            )
        gguf = gguf or bench.default_gguf()
    print(f"machine: {bu.machine_line(info)}", flush=True)
    model = bench.resolve_model(args.model)
    text = bench.find_text().read_text(encoding="utf-8")
    ids_long, _ = bench.tokenize_text(text, model, gguf, max(contexts))
    spec = {
        "model": str(model), "gguf": gguf, "device": "cpu", "dtype": None,
        "default_dtype": "float32", "threads": args.threads, "contexts": contexts,
        "max_ctx": max(contexts), "ids_long": ids_long,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gemma_rounds_") as tmp:
        tmp = Path(tmp)
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        workers: dict[str, Worker] = {}
        try:
            for n in names:  # one at a time: a compile takes both cores
                workers[n] = Worker(n, spec_path, args, tmp)
                ready = workers[n].ready()
                print(f"{n}: loaded in {ready['load_s']:.1f} s, warmed up in "
                      f"{ready['warmup_s']:.1f} s", flush=True)  # fmt: skip
            results = run_rounds(workers, args, contexts)
        finally:
            for w in workers.values():
                w.close()
    results.update(
        info=info, names=names, reference=reference, rounds=args.rounds, command=bu.command_line()
    )
    text = report(results, names, reference, info, args)
    print("\n" + text)
    if args.docs:
        bu.atomic_write_text(args.docs / "rounds.md", text)
        bu.atomic_write_json(args.docs / "rounds.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
