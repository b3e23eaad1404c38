"""Compiled graphs saved whole, so that a new process loads them without torch's compiler.

The compile cache (compile_cache.py) spares a second process inductor's work but not Dynamo's:
a graph's first call still traces the model's Python before the cached code is found, 5-8 s
per graph for the default model on two cores. So each CPU graph is built ahead of time with
AOTInductor: ``torch.export`` traces ``function(model, *args)`` once, and
``torch._inductor.aoti_compile_and_package`` compiles the program, its C++ wrapper included,
into one package file (a zip holding a shared object). Loading the package is C++ alone
(``torch._C._aoti.AOTIModelPackageLoader``): no Dynamo, no guards, no Python between the
kernels. Against the graphs that Dynamo's own ahead-of-time compile saved before (2026-12-06,
the default model in int8, one token at kv bucket 128, the project's 2-core VM): the same
logits bit for bit, a step 8.3 against 9.5 ms (the inputs are three small tensors instead of
~400, the weights being the package's constants), and a fresh process imports neither Dynamo
nor inductor (~1.1-1.9 s of Python) nor rebuilds guards (~0.6 s) before its first token.

A saved graph lives in the compile cache's folder (keyed by torch, CPU and Python), under a
name that hashes what decides the traced graph: the engine's own source, the model's config,
the names, shapes, strides and dtypes of its parameters and buffers, the function, its
arguments' shapes and values, the thread count (inductor writes it into its loops) and the
output layer's kernel (cpu.LIBRARY_GEMV_FOR_OUTPUT). The package holds no weights: the model's
own parameters and buffers are handed to it as user-managed constants (used in place, not
copied), so another checkpoint of the same shapes loads the same file and the decode step
writes the model's KV cache buffers in place, as the eager model does. The engine allocates
those tensors once; a graph is bound to the tensors it was given.

Used for CPU graphs in one process. CUDA (whose graphs need ``mode="reduce-overhead"``) and
tensor parallelism (collectives inside the graph) keep torch.compile's usual path, as does a
graph that cannot be exported (a marker file remembers it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import compile_cache, cpu

FOLDER = compile_cache.SAVED_GRAPHS  # inside the compile cache's folder
SUFFIX = ".pt2"


@functools.cache
def _source_digest() -> str:
    """A digest of the engine's Python source: a change to it may change any traced graph."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _describe(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype)]
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    raise TypeError(f"a saved graph's argument must be a tensor or a plain value, not {value!r}")


def _tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    return dict(itertools.chain(model.named_parameters(), model.named_buffers()))


def file_name(model: torch.nn.Module, function: Callable, args: tuple) -> str:
    """The name of the saved graph of ``function(model, *args)``.

    Inductor's settings (cpu.compile_config) are not read here: importing inductor would
    import Dynamo (~1.1 s) in a process that only loads. They follow from what the cache
    folder's key holds (the capability, ``TORCHINDUCTOR_CPP_MARCH``), except GCC's version,
    which decides only whether a faster move width is used under AVX2."""
    key = {
        "source": _source_digest(),
        "config": repr(getattr(model, "config", None)),
        "tensors": [[name, _describe(t)] for name, t in _tensors(model).items()],
        "function": function.__qualname__,
        "args": [_describe(a) for a in args],
        "threads": torch.get_num_threads(),
        "output_gemv": cpu.LIBRARY_GEMV_FOR_OUTPUT,
        "format": "aoti-1",
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return f"{function.__name__}-{digest}{SUFFIX}"


class Bound:
    """A saved graph bound to its model's tensors, called with ``function``'s arguments.

    The plain arguments (the kv bucket) are part of the graph; the tensors are its inputs,
    checked against the shapes it was built for (the engine checks their dtype and device
    itself, see Engine.step) and made contiguous: the compiled code indexes them with the
    strides they had when it was traced, contiguous ones (a no-op for the engine's own fresh
    tensors). The model's parameters and buffers are the package's constants, read and
    written in place: the model must keep them (it allocates them once)."""

    def __init__(self, loader: Any, model: torch.nn.Module, args: tuple) -> None:
        self.loader = loader
        self.model = model  # keeps the constants alive as long as the graph
        self.positions = tuple(i for i, a in enumerate(args) if isinstance(a, Tensor))
        self.shapes = tuple(args[i].shape for i in self.positions)

    def __call__(self, *args: Any) -> Tensor:
        inputs = [args[i].contiguous() for i in self.positions]
        shapes = tuple(t.shape for t in inputs)
        if shapes != self.shapes:
            raise ValueError(
                f"a saved graph built for inputs of shapes {self.shapes} was called with {shapes}"
            )
        (out,) = self.loader.run(inputs)
        return out


_OPENING = threading.Lock()  # one loader at a time points the temporary directory aside


def _open(path: Path) -> Any:
    """torch's loader of the package at ``path``, leaving nothing in the temporary directory.

    The loader unzips a package into a folder of its own under the temporary directory
    (``aotinductor_XXXXXX``), maps the shared object from there, and removes the folder when
    it is destroyed, which a process that leaves with ``os._exit`` (gemma-run) or is killed
    never does: every run left 3-7 MB behind in /tmp, and a damaged package, whose loader
    fails after unzipping, its folder too. Once the object is mapped its files are no longer
    read (the weights are the model's tensors, a CPU graph has no kernel files to load later).
    So the loader unzips into a private folder (``TMPDIR`` pointed at it while it is made),
    removed at once whether loading worked or not."""
    with _OPENING:
        private = tempfile.mkdtemp(prefix="gemma-engine-graph-")
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = private
        try:
            # (model name, one runner, run with OpenMP as built, the CPU)
            return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        finally:
            if before is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = before
            shutil.rmtree(private, ignore_errors=True)


class BrokenGraph(Exception):
    """A saved graph that does not load (damaged, or written by other code)."""


def load(path: Path, model: torch.nn.Module, args: tuple) -> Bound | None:
    """The graph saved at ``path`` bound to ``model``, or None when there is none. A file
    that does not load raises BrokenGraph: the engine then clears the compile cache and
    builds it again."""
    if not path.is_file():
        return None
    try:
        loader = _open(path)
        tensors = _tensors(model)
        constants = {}
        for name in loader.get_constant_fqns():
            own = name.removeprefix("model.")
            if own not in tensors:
                raise KeyError(f"the graph's constant {name} is not one of the model's tensors")
            constants[name] = tensors[own]
        # Used in place (user-managed), not copied; every constant given (a full update).
        loader.load_constants(constants, False, True, True)
    except Exception as err:
        raise BrokenGraph(f"{path.name}: {type(err).__name__}: {err}") from err
    with contextlib.suppress(OSError):  # used now: the cache keeps it (compile_cache.trim)
        os.utime(path)
    return Bound(loader, model, args)


class _Call(torch.nn.Module):
    """``function(model, *args)`` as a module taking only the tensor arguments."""

    def __init__(self, model: torch.nn.Module, function: Callable, args: tuple) -> None:
        super().__init__()
        self.model = model
        self.function = function
        # The plain arguments, with None where a tensor is given at each call.
        self.plain = tuple(None if isinstance(a, Tensor) else a for a in args)
        self.given = tuple(isinstance(a, Tensor) for a in args)

    def forward(self, *tensors: Tensor) -> Tensor:
        given = iter(tensors)
        args = [next(given) if g else a for g, a in zip(self.given, self.plain, strict=True)]
        return self.function(self.model, *args)


def build(model: torch.nn.Module, function: Callable, args: tuple, path: Path) -> None:
    """Trace ``function(model, *args)`` (one graph, these shapes) and compile it into a package
    at ``path`` (through a temporary name in the same folder, then renamed)."""
    import torch._inductor  # (imports Dynamo: only a process that builds a graph needs it)

    compile_cache.before_compiling()
    call = _Call(model, function, args)
    inputs = tuple(a for a in args if isinstance(a, Tensor))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.partial-{os.getpid()}{SUFFIX}")  # aoti: .pt2
    try:
        with torch.no_grad(), cpu.compile_config(), warnings.catch_warnings():
            # (torch 2.13's packaging pickles a tree spec through a deprecated check, which
            # warns on every build: torch's business, not the user's)
            warnings.filterwarnings("ignore", category=FutureWarning)
            # Export's default tracing (non-strict): the Python runs once on fake tensors,
            # recording the operations; no bytecode analysis. (Weights are not read here:
            # the model's tensors are given to the package at load, see load().)
            program = torch.export.export(call, inputs)
            torch._inductor.aoti_compile_and_package(
                program,
                package_path=str(partial),
                inductor_configs={
                    # No weights in the file: the model's tensors are given at load (load()).
                    "aot_inductor.package_constants_in_so": False,
                    # Inductor writes a 1-D tensor of at most 8 values into the code as
                    # numbers (a small bias): it would keep the building model's values.
                    "always_keep_tensor_constants": True,
                },
            )
        signature = program.graph_signature
        owners = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
        lifted = {  # "model.<the model's name>", for each one the graph reads
            owners[node.name]
            for node in program.graph.nodes
            if node.op == "placeholder" and node.name in owners and node.users
        }
        loader = _open(partial)
        if missing := lifted - set(loader.get_constant_fqns()):
            raise RuntimeError(f"the package holds the model's {sorted(missing)[0]} as its own")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def get(
    folder: Path,
    model: torch.nn.Module,
    function: Callable,
    args: tuple,
    building: Callable[[], None] = lambda: None,
) -> tuple[Bound, bool] | None:
    """``function`` compiled for ``args`` and bound to ``model``, with whether it was loaded:
    loaded from ``folder`` when saved there, else built (``building()`` called first), saved,
    and loaded back (as the next process will). None when this graph cannot be built ahead
    of time (``torch.export`` refuses what it cannot trace as one graph): the caller then
    compiles it as usual, and a marker file beside the graph's name keeps later processes
    from trying again."""
    args = tuple(a.contiguous() if isinstance(a, Tensor) else a for a in args)  # as Bound
    path = folder / FOLDER / file_name(model, function, args)
    marker = path.with_suffix(".unsaved")
    if marker.exists():
        return None
    graph = load(path, model, args)
    if graph is not None:
        return graph, True
    building()
    try:
        build(model, function, args, path)
        graph = load(path, model, args)
        if graph is None:
            raise FileNotFoundError(f"{path} was not written")
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
    compile_cache.trim(folder, keep=path)
    return graph, False
