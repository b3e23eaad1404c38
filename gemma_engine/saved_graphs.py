"""Compiled graphs saved whole, so that a new process loads them without tracing the model.

The compile cache (compile_cache.py) spares a second process inductor's work but not Dynamo's:
a graph's first call still traces the model's Python before the cached code is found, 5-8 s
per graph for the default model on two cores. torch's ahead-of-time compile
(``torch.compile(...).aot_compile``, experimental in 2.13) keeps the traced graph, its guards
and the generated code in one file, and loading that file skips the tracing (BENCHMARKS.md has
the figures).

A saved graph lives in the compile cache's folder (keyed by torch, CPU and Python), under a
name that hashes what decides the traced graph: the engine's own source, the model's config,
the names, shapes and dtypes of its parameters and buffers, the function, its arguments'
shapes and values, the thread count (inductor writes it into its loops) and the output
layer's kernel (cpu.LIBRARY_GEMV_FOR_OUTPUT). The weights are inputs of the graph, not
constants in it, so another checkpoint of the same shapes loads the same file. Like
inductor's own cache entries, the file is a pickle: it is only ever read from that folder,
which this engine writes, never from a file a user or a request names.

Used for CPU graphs in one process. CUDA (whose graphs need ``mode="reduce-overhead"``) and
tensor parallelism (collectives inside the graph) keep torch.compile's usual path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import itertools
import json
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import compile_cache, cpu

FOLDER = "graphs"  # inside the compile cache's folder
SUFFIX = ".graph"
# What a fresh process imports to load a saved graph (torch 2.13): dynamo, then these parts
# of inductor and aot_autograd, ~1.6 s of Python on this project's 2-core VM.
_LOADER_MODULES = (
    "torch._dynamo",
    "torch._dynamo.repro.after_dynamo",
    "torch._inductor.compiler_bisector",
    "torch._inductor.decomposition",
    "torch._inductor.graph",
    "torch.utils.cpp_extension",
    "torch._functorch._aot_autograd.subclass_codegen",
)


@contextlib.contextmanager
def compiler_imported_alongside() -> Iterator[None]:
    """Import what loading a saved graph needs in a thread while the body runs (the weights
    load), in a process that has not imported dynamo yet; joined on leaving.

    Both are CPU work: the imports are Python on one core, holding the GIL; the loading is
    mostly ATen copies and oneDNN's packing, on torch's threads with the GIL released. So
    torch gets one thread fewer meanwhile, leaving the imports their core (on two cores a
    second ATen thread would wait on it at every parallel loop), and the GIL changes hands
    every 0.2 ms instead of 5, so that the loading gets it back soon after each ATen call.
    ``from_pretrained`` of the default model in int8 took 1.8-1.9 s so, imports included,
    against 2.6 s one after the other (the project's 2-core VM; BENCHMARKS.md, 2026-12-06). A
    name that no longer imports (another torch) is skipped: the loader imports what it needs
    itself.
    """
    if "torch._dynamo" in sys.modules:  # a second engine, the tests: nothing left to overlap
        yield
        return

    def run() -> None:
        for name in _LOADER_MODULES:
            with contextlib.suppress(Exception):
                importlib.import_module(name)

    thread = threading.Thread(target=run, name="gemma-engine-imports", daemon=True)
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(max(1, threads - 1))
    sys.setswitchinterval(min(interval, 2e-4))
    thread.start()
    try:
        yield
    finally:
        thread.join()
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)


@functools.cache
def _source_digest() -> str:
    """A digest of the engine's Python source: a change to it may change any traced graph."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def inductor_settings() -> contextlib.AbstractContextManager:
    """Inductor's C++ wrapper for the saved graphs: the Python function that calls a graph's
    kernels (inductor's default wrapper) checks each of the ~400 weights' sizes, makes ~900
    views of its buffers and deletes ~1400 names at every call, ~1.1 ms of a ~17.9 ms int8
    decode step of the default model (2026-12-06, four alternating pairs of fresh processes,
    300 steps each: 17.5-18.5 against 16.2-17.2 ms); compiled C++ does the same in microseconds.
    It costs a longer first compile (the default model's int8 decode graph: 108 against 84 s)
    and nothing measurable for the tests' tiny models. Only here: torch.compile's own path
    (CUDA graphs, tensor parallelism's collectives) keeps the Python wrapper."""
    return torch._inductor.config.patch(cpp_wrapper=True)


def _describe(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype)]
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    raise TypeError(f"a saved graph's argument must be a tensor or a plain value, not {value!r}")


def file_name(model: torch.nn.Module, function: Callable, args: tuple) -> str:
    """The name of the saved graph of ``function(model, *args)``."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    key = {
        "source": _source_digest(),
        "config": repr(getattr(model, "config", None)),
        "tensors": [[name, list(t.shape), str(t.dtype)] for name, t in tensors],
        "function": function.__qualname__,
        "args": [_describe(a) for a in args],
        "threads": torch.get_num_threads(),
        "march": str(torch._inductor.config.cpp.march),
        "contract": torch._inductor.config.cpp.enable_floating_point_contract_flag,
        "output_gemv": cpu.LIBRARY_GEMV_FOR_OUTPUT,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return f"{function.__name__}-{digest}{SUFFIX}"


def load(path: Path) -> Callable | None:
    """The graph saved at ``path``, or None when there is none. A file that does not load
    raises BrokenGraph: the engine then clears the compile cache and builds it again."""
    try:
        # Inductor would preprocess its C++ wrapper's header again, to key a precompiled
        # header that only a compile uses (0.17 s of a fresh process's start on two cores):
        # the graph's shared objects are already built.
        with (
            open(path, "rb") as f,
            torch._inductor.config.patch(cpp_cache_precompile_headers=False),
        ):
            return torch.compiler.load_compiled_function(f)
    except FileNotFoundError:
        return None
    except Exception as err:
        raise BrokenGraph(f"{path.name}: {type(err).__name__}: {err}") from err


class Bound:
    """A saved graph bound to its model, checking dynamo's guards on its first call only.

    The guards check that the model's tensors (about 400 for the default model) and the
    arguments still have the shapes, dtypes and devices that were traced: 0.2 ms per call, and
    0.2-0.8 ms of a 16.5 ms int8 decode step (the check also evicts cached lines). Once a call
    has passed them, nothing the engine does changes them: it allocates the model's tensors
    once and keys each graph on its arguments' shapes (the engine checks their dtypes and
    device itself, see Engine.step), so later calls skip the check.
    """

    def __init__(self, graph: Callable, model: torch.nn.Module) -> None:
        self.graph = graph
        self.model = model
        self.checked = False

    def __call__(self, *args: Any) -> Any:
        if self.checked:
            return self.graph(self.model, *args)
        with inductor_settings():  # a first call may still load the graph's code
            out = self.graph(self.model, *args)
        self.graph.disable_guard_check()
        self.checked = True
        return out


class BrokenGraph(Exception):
    """A saved graph that does not load (damaged, or written by other code)."""


def build(model: torch.nn.Module, function: Callable, args: tuple) -> Callable:
    """Trace and compile ``function(model, *args)`` ahead of time (one graph, these shapes)."""
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(function, fullgraph=True, dynamic=False)
    return compiled.aot_compile(((model, *args), {}))


def save(graph: Callable, path: Path) -> None:
    """Write ``graph`` to ``path`` (through a temporary name in the same folder, then renamed:
    torch's own writer does both)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    graph.save_compiled_function(str(path))


def get(
    folder: Path, model: torch.nn.Module, function: Callable, args: tuple
) -> tuple[Callable, bool] | None:
    """``function`` compiled for ``args`` and bound to ``model``, with whether it was loaded:
    loaded from ``folder`` when saved there, else built, saved, and loaded back once to check
    that it can be. None when this graph cannot be saved whole (torch's ahead-of-time compile
    is experimental): the caller then compiles it as usual, and a marker file beside the
    graph's name keeps later processes from trying again."""
    path = folder / FOLDER / file_name(model, function, args)
    marker = path.with_suffix(".unsaved")
    if marker.exists():
        return None
    with inductor_settings():
        return _get(path, marker, model, function, args)


def _get(
    path: Path, marker: Path, model: torch.nn.Module, function: Callable, args: tuple
) -> tuple[Callable, bool] | None:
    graph = load(path)
    if graph is not None:
        return Bound(graph, model), True
    try:
        graph = build(model, function, args)
        save(graph, path)
        load(path)  # what the next process will do
    except Exception as err:
        path.unlink(missing_ok=True)
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:240]
        compile_cache.warn(
            f"{function.__qualname__} cannot be saved whole for later runs ({reason}); they "
            "will trace it again (seconds per graph)"
        )
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(reason + "\n")
        return None
    return Bound(graph, model), False
