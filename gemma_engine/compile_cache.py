"""Where compiled graphs live between processes, and what happens when one is bad.

TorchInductor keeps what it builds (the generated C++, the shared objects, the wrappers that
call them) in a cache folder, so a second process that traces the same graph loads it instead
of compiling it again: seconds instead of minutes on a small CPU. gemma-engine gives that cache
a folder of its own for each machine and torch build,

    $GEMMA_ENGINE_CACHE (default $XDG_CACHE_HOME/gemma-engine or ~/.cache/gemma-engine)
        /inductor/<torch version>-<capability>-<key>

where the key covers what decides whether generated code runs here and runs right: torch's
version, PyTorch's CPU capability (inductor does not key its own cache on it: code generated
for AVX2 and found again under AVX-512 wrote past its buffers), the CPU's model and instruction
flags, the machine and Python's version. Another torch or another CPU finds another folder and
compiles afresh. The model is not in the key: inductor keys each graph by its code, shapes and
dtypes, and the weights are inputs of the graph, not constants in it, so another checkpoint of
the same shapes reuses the graphs and other shapes build their own.

Each folder holds a stamp (``stamp.json``) that repeats its key. A folder whose stamp is missing
or names another key, and a cached graph that fails to load, are set aside with one line on
stderr, and the graph is built again. ``TORCHINDUCTOR_CACHE_DIR``, when set to another folder
than inductor's default, is used as it is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from . import cpu

STAMP = "stamp.json"
# A machine folder keeps its most recently used entries up to this size (trim()).
KEEP_BYTES = 2 << 30
# Entries written this recently stay whatever the size: another process may be building them.
IN_USE_SECONDS = 3600
# Inductor's answers about the vector instruction sets (see remember_vector_checks).
VECTOR_CHECKS = "vector_checks.json"
SAVED_GRAPHS = "graphs"  # the subfolder of graphs saved whole (saved_graphs.py)
_folder: Path | None = None  # this process's, once use() found one
_checks_file: Path | None = None  # its vector checks, once a graph is built
# Where torch logs a cached graph it could not load (then builds it anew), with a traceback each.
_LOADERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")


def _cpu_description() -> str:
    """The CPU's model name and instruction-set flags (Linux); the platform's name elsewhere."""
    fields = cpu.cpuinfo_fields()
    if fields is None:
        return platform.processor() or platform.machine()
    found = {
        name: fields[name] if name == "model name" else " ".join(sorted(fields[name].split()))
        for name in ("model name", "flags", "Features", "CPU part")
        if name in fields
    }
    return json.dumps(found, sort_keys=True)


@functools.cache
def machine_key() -> dict[str, str]:
    """What a folder of compiled graphs is valid for."""
    return {
        "torch": torch.__version__,
        "capability": cpu.capability(),
        "cpu": _cpu_description(),
        "machine": platform.machine(),
        "python": ".".join(map(str, sys.version_info[:2])),
        "march": os.environ.get("TORCHINDUCTOR_CPP_MARCH", ""),
    }


def folder_name() -> str:
    key = machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return f"torch-{key['torch']}-{key['capability'].lower()}-{digest}"


def root() -> Path:
    if "GEMMA_ENGINE_CACHE" in os.environ:
        return Path(os.environ["GEMMA_ENGINE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gemma-engine"


def warn(text: str) -> None:
    """One warning line on stderr (the engine's warnings about its compiled graphs)."""
    print(f"gemma-engine: warning: {text}", file=sys.stderr)


def use() -> Path | None:
    """Point TorchInductor at this machine's folder (made and stamped if new); the folder, or
    None when ``TORCHINDUCTOR_CACHE_DIR`` was set by the user or no folder can be made (then
    inductor's default applies, or, under a lowered capability, a sibling of it).
    """
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # importing inductor sets the default
    folder = root() / "inductor" / folder_name()
    # A second engine in this process finds the folder the first one set. (Inductor is
    # imported only where it is already: it imports Dynamo, ~1.1 s, which a process that
    # loads its saved graphs never needs, see saved_graphs.py.)
    ours = {os.path.abspath(folder)}
    if "torch._inductor" in sys.modules:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        ours.add(os.path.abspath(default_cache_dir()))
    if current and os.path.abspath(current) not in ours:
        return None
    try:
        _check_stamp(folder)
    except OSError as err:
        warn(f"cannot use {folder} for compiled graphs ({err.strerror or err}); using torch's")
        cpu.isolate_compile_cache()
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    global _folder
    _folder = folder
    return folder


def before_compiling() -> None:
    """Called before the engine builds a graph: from then on inductor's vector checks are
    answered from this process's folder (remember_vector_checks), once use() has found one."""
    if _folder is not None:
        remember_vector_checks(_folder)


def remember_vector_checks(folder: Path) -> None:
    """Keep the answer of each of inductor's vector-instruction checks in ``folder``.

    Before the first graph a process loads, inductor checks each vector instruction set the
    CPU's flags name (AVX2, AVX-512, its VNNI and BF16 parts, AMX): it compiles a test program
    for it, or finds it compiled, and loads it in a child Python. That took ~0.5 s of every
    fresh process's start on two cores (the children), only to learn again what an earlier
    process here had learned. The folder's key covers torch, the CPU and its capability; each
    answer is filed under the test program, the compiler's version and its flags (what inductor
    names the program's build by), so a check runs once per folder and compiler, and later
    processes read its answer.
    """
    global _checks_file
    _checks_file = folder / VECTOR_CHECKS
    from torch._inductor import cpu_vec_isa

    check = cpu_vec_isa.VecISA.check_build
    if getattr(check, "remembered", False):
        return

    @functools.wraps(check)
    def remembered(isa, code: str) -> bool:
        path = _checks_file
        if path is None:
            return check(isa, code)
        flags = cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags())
        key = hashlib.sha256(f"{flags}\0{code}".encode()).hexdigest()
        answer = _read_checks(path).get(key)
        if not isinstance(answer, bool):
            answer = check(isa, code)
            with contextlib.suppress(OSError):
                _write_atomic(path, json.dumps({**_read_checks(path), key: answer}))
        return answer

    remembered.remembered = True
    cpu_vec_isa.VecISA.check_build = remembered


def _read_checks(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _check_stamp(folder: Path) -> None:
    """Make sure ``folder`` holds this machine's stamp. A new or empty folder is stamped (an
    empty one may be another process's, about to stamp it); one stamped for another machine,
    or holding files but no readable stamp, is set aside with one warning line and made anew."""
    stamp = folder / STAMP
    if folder.is_dir():
        try:
            found = json.loads(stamp.read_text())
        except (OSError, ValueError):
            found = None
        if found == machine_key():
            return
        if found is not None or any(not p.name.startswith(".") for p in folder.iterdir()):
            why = "has no readable stamp" if found is None else "was made for another torch or CPU"
            warn(f"the compiled-graph cache {folder} {why}; it is cleared and rebuilt")
            _set_aside(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(stamp, json.dumps(machine_key(), indent=1, sort_keys=True))


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _set_aside(folder: Path) -> None:
    """Rename the folder out of the way (atomic; another process may be reading it), then
    remove it."""
    aside = folder.with_name(f".{folder.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
    try:
        folder.rename(aside)
    except OSError:
        aside = folder
    shutil.rmtree(aside, ignore_errors=True)


def trim(folder: Path, keep: Path | None = None) -> None:
    """Remove the least recently used entries of the machine folder ``folder`` past
    KEEP_BYTES, so that the graphs of engine versions and options no longer run do not pile
    up (each version of the engine's source names its graphs anew, saved_graphs.py). An entry
    is a saved graph (used: loading touches it), or one of inductor's folders of generated
    code (used: written when a graph is built). Entries written within IN_USE_SECONDS, and
    ``keep``, stay; so do the stamp, the vector checks and the markers of graphs that cannot
    be saved. Called after a graph is built (saved whole, or by torch.compile), never when
    one is loaded."""
    entries = []
    try:
        for top in folder.iterdir():
            if top.name in (STAMP, VECTOR_CHECKS, "locks") or top.name.startswith("."):
                continue
            if top.name in (SAVED_GRAPHS, "fxgraph", "aotautograd") and top.is_dir():
                entries += [p for p in top.iterdir() if p.suffix != ".unsaved"]
            else:
                entries.append(top)
    except OSError:
        return
    remove_least_recent(entries, KEEP_BYTES, keep, recent=time.time() - IN_USE_SECONDS)


def remove_least_recent(
    entries: list[Path], keep_bytes: int, keep: Path | None, recent: float = float("inf")
) -> None:
    """Remove the least recently written of ``entries`` (files or folders) past the newest
    ``keep_bytes``; ``keep``, and entries written after the time ``recent``, stay. The
    eviction of both caches: this one (trim) and the quantized weights' (quantized_cache)."""
    described = []
    for entry in entries:
        with contextlib.suppress(OSError):
            described.append((*_size_and_time(entry), entry))
    total = 0
    for size, mtime, entry in sorted(described, key=lambda e: e[1], reverse=True):
        total += size
        if total > keep_bytes and entry != keep and mtime < recent:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()


def _size_and_time(entry: Path) -> tuple[int, float]:
    """The bytes of the files of ``entry`` and the latest time any of it was written."""
    st = entry.stat()
    if not entry.is_dir():
        return st.st_size, st.st_mtime
    size, mtime = 0, st.st_mtime
    for parent, _, files in os.walk(entry):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(parent, name))
                size += st.st_size
                mtime = max(mtime, st.st_mtime)
    return size, mtime


@contextlib.contextmanager
def watch_loads() -> Iterator[list[str]]:
    """While a graph is built: catch what torch logs about cached entries it could not load
    (it builds those anew, and logs a traceback for each); yield a list that collects one
    line per failure, for the caller to report once."""
    failures: list[str] = []

    def catch(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.levelno < logging.WARNING or "cache" not in text.lower():
            return True
        error = record.exc_info[1] if record.exc_info else None
        failures.append(f"{text} ({type(error).__name__}: {error})" if error else text)
        return False

    loggers = [logging.getLogger(name) for name in _LOADERS]
    for logger in loggers:
        logger.addFilter(catch)
    try:
        yield failures
    finally:
        for logger in loggers:
            logger.removeFilter(catch)


class BrokenEntries(Exception):
    """Cached entries torch could not load while it built a graph. It built the graph anyway,
    but keeps the broken entries and tries them first every time: the cache is cleared."""

    def __init__(self, failures: list[str]) -> None:
        more = f" and {len(failures) - 1} more" if len(failures) > 1 else ""
        super().__init__(f"{failures[0]}{more}")


def recover(error: BaseException) -> bool:
    """After building a graph failed, or met broken cached entries: if the cache folder in use
    is ours, say so on one line, clear it and forget this process's compiled graphs, and return
    True (build it again); else False (the error is not the cache's to fix)."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder or Path(folder).name != folder_name() or not (Path(folder) / STAMP).exists():
        return False
    detail = str(error) if isinstance(error, BrokenEntries) else f"{type(error).__name__}: {error}"
    detail = " ".join(detail.split())[:240]
    warn(
        f"a compiled graph in {folder} could not be loaded ({detail}); the cache is cleared "
        "and the graph built again"
    )
    _set_aside(Path(folder))
    _check_stamp(Path(folder))
    torch._dynamo.reset()
    return True
