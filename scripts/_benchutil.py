"""Helpers shared by the benchmark scripts (not part of the engine).

Timing statistics, the machine description, a memory-bandwidth probe, Markdown
tables, and atomic writes of the reports (a temporary file in the same folder,
then a rename, so that an interrupted run never leaves half a file behind).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = REPO / "BENCHMARKS.md"
DOCS = REPO / "docs"

BENCHMARKS_HEADER = """\
# Benchmarks

Measured figures from `scripts/bench.py` (`make bench`), `scripts/bench_buckets.py` and
`scripts/bench_gpu.sh`. Each run appends a dated section below with the machine, the
library versions and the exact command; nothing here is estimated or copied from elsewhere
unless it is labelled as a reference figure. Older sections are kept as a record: compare
numbers only within one section (one run, one machine state).

GPU figures: **pending**. `scripts/bench_gpu.sh` runs both benchmarks on CUDA (bf16, CUDA
graphs) when a GPU machine is available; no GPU was available when the first CPU figures
were taken.
"""


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Summary:
    """Median, min and max of repeated measurements (seconds, or any unit)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        if not samples:
            raise ValueError("no samples to summarise")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def inverse(self, scale: float = 1.0) -> Summary:
        """The rate scale/x: its median is scale/median, its min comes from the max."""
        return Summary(scale / self.median, scale / self.max, scale / self.min, self.n)

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}

    def fmt(self, digits: int = 1) -> str:
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"


def summary_from_dict(d: dict | None) -> Summary | None:
    if d is None:
        return None
    return Summary(d["median"], d["min"], d["max"], d["n"])


class Timer:
    """Wall-clock timer for `with` blocks; synchronises CUDA when asked to."""

    def __init__(self, sync=None):
        self._sync = sync
        self.seconds = float("nan")

    def __enter__(self) -> Timer:
        if self._sync is not None:
            self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._sync is not None:
            self._sync()
        self.seconds = time.perf_counter() - self._t0


def cuda_sync_for(device: str):
    """A callable that waits for queued device work, or None on the CPU."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return None


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = [
                    "avx2",
                    "fma",
                    "avx512f",
                    "avx512_vnni",
                    "avx512_bf16",
                    "avx_vnni",
                    "amx_tile",
                ]
                return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
        head = out.stdout.strip() if out.returncode == 0 else "no commit"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - any failure means "not installed" here
        return "not installed"


def machine_info(device: str, threads: int | None) -> dict:
    """What the figures were measured on, for the report header."""
    import torch

    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "lowered": {k: os.environ[k] for k in LOWERED_ENV_KEYS if k in os.environ},
        "mem_gib": _mem_total_gib(),
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama-cpp-python"),
        "git": _git_commit(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def machine_line(info: dict) -> str:
    mem = f"{info['mem_gib']:.0f} GiB" if info.get("mem_gib") else "? GiB"
    parts = [
        f"{info['cpu']} ({info['cpu_count']} cores; {', '.join(info['cpu_flags']) or 'flags ?'})",
        mem,
    ]
    if info.get("gpu"):
        parts.insert(0, info["gpu"])
    if info.get("torch_threads"):
        parts.append(f"torch threads {info['torch_threads']}")
    if info.get("capability"):
        lowered = info.get("lowered") or {}
        how = ", ".join(f"{k}={v}" for k, v in lowered.items())
        parts.append(f"PyTorch CPU capability {info['capability']}" + (f" ({how})" if how else ""))
    return "; ".join(parts)


def versions_line(info: dict) -> str:
    return (
        f"Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"llama-cpp-python {info['llama_cpp_python']}, gemma-engine git {info['git']}"
    )


def peak_rss_bytes() -> int:
    """Peak resident set size of this process.

    Linux: VmHWM from /proc/self/status, the high-water mark of this program's own memory.
    Not getrusage's ru_maxrss: across fork + exec that keeps the parent's peak, so every
    worker process would report at least its launcher's size.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# --------------------------------------------------------------------------- other load
# The figures are only as good as the machine was quiet. These helpers measure how much CPU
# other processes used while we measured (machine-wide busy time from /proc/stat minus this
# process's and its children's CPU time), and can wait for a quiet machine before starting.


def _machine_busy_seconds() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class OtherLoad:
    """Average number of CPU cores that *other* processes kept busy between start and stop.

    Children are counted as ours only once they have exited (getrusage), so stop() a window
    after the subprocesses it covers have finished.
    """

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._m0, self._o0, self._t0 = _machine_busy_seconds(), _own_cpu_seconds(), time.time()

    def stop(self) -> float | None:
        m1, o1, t1 = _machine_busy_seconds(), _own_cpu_seconds(), time.time()
        if self._m0 is None or m1 is None or t1 <= self._t0:
            return None
        return max(0.0, ((m1 - self._m0) - (o1 - self._o0)) / (t1 - self._t0))


def wait_for_quiet(max_wait: float, threshold: float = 0.2, probe: float = 3.0) -> float | None:
    """Wait (up to max_wait seconds) until other processes use < threshold cores.

    Returns the last probe's figure (cores busy with other work), or None where /proc/stat
    is unreadable.
    """
    deadline = time.time() + max_wait
    while True:
        load = OtherLoad()
        time.sleep(probe)
        busy = load.stop()
        if busy is None or busy < threshold or time.time() >= deadline:
            if busy is not None and busy >= threshold:
                print(
                    f"  (machine still busy: other processes use {busy:.2f} cores; "
                    "measuring anyway)",
                    flush=True,
                )
            return busy
        print(
            f"  waiting for a quiet machine: other processes use {busy:.2f} cores ...", flush=True
        )
        time.sleep(5)


# --------------------------------------------------------------------------- capability

# How a benchmark on an AVX-512 machine takes the code paths of an AVX2-only one (AMD Zen 2/3,
# many cloud VMs): ATen's kernels and inductor's vectors by ATEN_CPU_CAPABILITY, GCC's own code
# by -march=znver3 (what -march=native means on Zen 3: no AVX-512 instruction anywhere, Zen 3
# tuning), MKL, oneDNN and fbgemm by their ISA caps, and an inductor cache of its own (see
# gemma_engine/cpu.py). Memory bandwidth stays this machine's.
LOWERED_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "TORCHINDUCTOR_CPP_MARCH": "znver3",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    }
}
LOWERED_ENV_KEYS = sorted({k for env in LOWERED_ENV.values() for k in env})


def reexec_lowered(capability: str, llama_cpp_path: str | None = None) -> None:
    """Run this script again under ``capability`` ("native": as it is), once."""
    env = dict(os.environ)
    if llama_cpp_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [llama_cpp_path, env.get("PYTHONPATH")]))
    if capability == "native" or os.environ.get("ATEN_CPU_CAPABILITY") == capability:
        if llama_cpp_path and llama_cpp_path not in sys.path:
            sys.path.insert(0, llama_cpp_path)
            os.environ["PYTHONPATH"] = env["PYTHONPATH"]
        return
    env.update(LOWERED_ENV[capability])
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def llama_cpp_build() -> str:
    """Where llama_cpp comes from and which CPU features its ggml was built with."""
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode()
        feats = [f.split(" = ")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")]
        return f"{Path(llama_cpp.__file__).parent.parent} ({', '.join(feats)})"
    except Exception as err:  # noqa: BLE001 - report, do not fail
        return f"unavailable ({type(err).__name__})"


# --------------------------------------------------------------------------- bandwidth


def measure_bandwidth(device: str = "cpu", nbytes: int = 1 << 30, repeats: int = 7) -> dict:
    """Streaming read bandwidth of this device, in GB/s (1e9 bytes per second).

    Two probes over an fp32 buffer larger than any cache: a full reduction (`sum`,
    reads every byte once) and a copy (reads and writes every byte; counted as
    2 x nbytes). The read figure is the ceiling a memory-bound decode step can reach.
    """
    import torch

    sync = cuda_sync_for(device)
    n = nbytes // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    read, copy = [], []
    for _ in range(repeats):
        with Timer(sync) as t:
            x.sum()
        read.append(nbytes / t.seconds / 1e9)
        with Timer(sync) as t:
            y.copy_(x)
        copy.append(2 * nbytes / t.seconds / 1e9)
    del x, y
    # The first call of each pays page faults: drop it before taking the median.
    return {
        "read_gbs": statistics.median(read[1:]),
        "read_gbs_max": max(read[1:]),
        "copy_gbs": statistics.median(copy[1:]),
        "buffer_bytes": nbytes,
        "repeats": repeats - 1,
    }


# --------------------------------------------------------------------------- files


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_section(path: Path, section: str, header: str = BENCHMARKS_HEADER) -> None:
    """Append a Markdown section to `path` (created with `header` if missing), atomically."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else header
    if not old.endswith("\n"):
        old += "\n"
    atomic_write_text(path, old + "\n" + section.rstrip("\n") + "\n")


def save_figure(fig, path: Path) -> None:
    """Save a matplotlib figure as PNG through a temporary file and a rename."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(Path(path), buf.getvalue())


def md_table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A GitHub Markdown table; `align` is one of 'l', 'r' per column."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rel(path: Path, start: Path) -> str:
    """`path` relative to `start` when possible (for links in Markdown)."""
    try:
        return os.path.relpath(path, start)
    except ValueError:
        return str(path)


def command_line(argv: list[str] | None = None) -> str:
    """The command that produced a report, as a user would type it from the repo root."""
    args = sys.argv[1:] if argv is None else argv
    script = rel(Path(sys.argv[0]).resolve(), REPO)
    return " ".join(["python", script, *args])


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_ctx(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
