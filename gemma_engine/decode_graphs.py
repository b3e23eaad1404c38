"""Decode graphs: the one place where an engine's model is compiled.

Each (batch bucket, kv bucket) pair of decode steps is one graph
(``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``): shapes and the kv
length are static inside it, so it never recompiles and CUDA graphs apply. Greedy steps of a
model with an int8 screen of its output layer (greedy_screen.py) have graphs of their own,
keyed with "screened". On a CPU, a graph is saved whole as an AOTInductor package and loaded
by the next process (saved_graphs.py); elsewhere torch.compile builds it in its first call.

A prompt's one row of logits goes through a compiled output layer when that layer is
quantized (``DecodeGraphs.compiles_head``). Every first call says what it builds and how long
it took (``tell``), so that a compile's pause is never silent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from . import compile_cache, cpu, quant, saved_graphs
from .model import GemmaForCausalLM
from .slots import batch_buckets

# A graph's first call compiles it: minutes for the default model on a small CPU, the first time.
_CACHE_NOTE = "seconds when the compile cache has it, minutes the first time on a machine"

GraphKey = tuple[int, int] | tuple[int, int, str]


def graph_key(batch: int, kv_len: int, screened: bool = False) -> GraphKey:
    """How ``compile_seconds`` names a decode graph: (batch, kv bucket), with "screened" for
    the greedy graphs that read the int8 copy of the output layer (greedy_screen.py)."""
    return (batch, kv_len, "screened") if screened else (batch, kv_len)


class DecodeGraphs:
    """The compiled graphs of one engine's model, made on first use and kept."""

    # Decode graphs that all engines in this process may build: Dynamo counts graphs per code
    # object, shared by every engine, so the limit grows by each engine's (batch, kv) pairs.
    allowed = 0

    def __init__(
        self,
        model: GemmaForCausalLM,
        buckets: list[int],
        max_batch: int,
        tell: Callable[[str], None],
    ) -> None:
        self.model = model
        self.tell = tell  # one line of text: a graph starts compiling, or is ready
        # graph_key(...) -> seconds its first call took (it built or loaded the graph)
        self.compile_seconds: dict[GraphKey, float] = {}
        self._graphs: dict[GraphKey, Callable] = {}  # graph_key(...) -> its graph
        self._compiled: dict[str, Callable] = {}  # torch.compile's model (_torch_compiled)
        self._head_compiled: Callable | None = None  # and its output layer (_compiled_head)
        self.head_graphs: dict[tuple[int, ...], Callable] = {}  # hidden's shape -> its graph
        # Graphs built here are found again by the next process: in this folder, and on a CPU
        # saved whole in it (saved_graphs.py).
        self._folder = compile_cache.use()
        self._saved: Path | None = None
        device = model.model.embed_tokens.weight.device
        if self._folder is not None and device.type == "cpu" and model.tp is None:
            self._saved = self._folder
        # (Dynamo's and inductor's settings are per thread: step() applies them.)
        self.allow(len(buckets) * len(batch_buckets(max_batch)))
        if self._saved is None:  # else made only if a graph cannot be saved (Dynamo, ~1 s)
            self._torch_compiled(type(model).forward)
        head = model.output_layer()
        # A prompt's layers run eagerly (lengths vary, the matmuls are large), but its one row
        # of logits is a product with the whole output matrix, which eagerly would expand a
        # quantized matrix in full (seconds). Compiled, it streams the quantized bytes as
        # decode does. Float weights keep MKL's GEMV here: tens of milliseconds, against a
        # compile of up to 12 s before a fresh process's first token. So does an int8 output
        # layer with a library's packed copy (packed_int8.py, on x86 CPUs; engines of several
        # sequences, loading.load): ~9 ms eagerly. Without one, the saved graph loads with the
        # decode graphs (0.0 s; first token 0.16 s on a Zen 3, BENCHMARKS.md 2026-12-07).
        self.compiles_head = isinstance(head, quant.QuantizedLinear) and not head.packed

    @staticmethod
    def allow(graphs: int) -> None:
        """Raise the process's graph limit by ``graphs`` more (a speculator's verify graphs)."""
        DecodeGraphs.allowed += graphs

    def built(self, batch: int, kv_len: int, screened: bool) -> bool:
        return graph_key(batch, kv_len, screened) in self.compile_seconds

    def step(self, function: Callable, args: tuple) -> Tensor:
        """``function(model, *args)`` (the model's ``forward`` or ``screened``) for decode
        ``args`` (tokens (B, 1), input_pos (B, 1), kv_len, rows (B,)), through its graph."""
        B, kv_len = args[0].shape[0], args[2]
        plain = function is type(self.model).forward
        key = graph_key(B, kv_len, screened=not plain)
        graph = self._graphs.get(key)
        if isinstance(graph, saved_graphs.Bound):  # C++ alone, no settings to enter
            return graph(*args)
        if graph is not None:
            with self._compile_settings():
                return graph(*args)
        what = f"the {'decode' if plain else function.__name__ + ' decode'} graph for {B} "
        what += f"row{'s' * (B > 1)} and kv bucket {kv_len}"
        graph, out, seconds = self._first_call(
            what, "once per bucket", function, args, lambda: self._torch_compiled(function)
        )
        self._graphs[key] = graph
        self.compile_seconds[key] = seconds
        return out

    def head(self, hidden: Tensor) -> Tensor:
        """Logits (1, 1, vocab) of a prompt's last hidden state, through the compiled output
        layer (made on first use, one per shape)."""
        head = self.head_graphs.get(tuple(hidden.shape))
        if isinstance(head, saved_graphs.Bound):
            return head(hidden)
        if head is not None:
            with self._compile_settings():
                return head(hidden)
        what = "the output layer for prompts"
        logits_of = type(self.model).logits
        head, logits, _ = self._first_call(
            what, "once per process", logits_of, (hidden,), self._compiled_head
        )
        self.head_graphs[tuple(hidden.shape)] = head
        return logits

    def _torch_compiled(self, function: Callable) -> Callable:
        """torch.compile's wrapper of the model's ``function`` (made once): CUDA, tensor
        parallelism, and a CPU graph that cannot be saved whole (saved_graphs.py)."""
        if function.__name__ not in self._compiled:
            compile_cache.before_compiling()
            for layer in self.model.model.layers:  # CUDA graphs may keep these addresses fixed
                if (cache := layer.self_attn.cache) is not None:  # KV-shared layers have none
                    torch._dynamo.mark_static_address(cache.k)
                    torch._dynamo.mark_static_address(cache.v)
            target = (
                self.model
                if function is type(self.model).forward
                else getattr(self.model, function.__name__)
            )
            self._compiled[function.__name__] = torch.compile(
                target, mode="reduce-overhead", fullgraph=True, dynamic=False
            )
        return self._compiled[function.__name__]

    def _compiled_head(self) -> Callable:
        if self._head_compiled is None:
            compile_cache.before_compiling()
            self._head_compiled = torch.compile(self.model.logits, fullgraph=True, dynamic=False)
        return self._head_compiled

    @staticmethod
    @contextlib.contextmanager
    def _compile_settings() -> Iterator[None]:
        """Inductor's settings for the engine's graphs and Dynamo's graph limits (both per
        thread), around every call of a graph that torch.compile may still build."""
        limit = max(DecodeGraphs.allowed, 8)
        limits = dict(recompile_limit=limit, accumulated_recompile_limit=max(limit, 256))
        with cpu.compile_config(), torch._dynamo.config.patch(limits):
            yield

    def _first_call(
        self,
        what: str,
        how_often: str,
        function: Callable,
        args: tuple,
        compiled: Callable[[], Callable],
    ) -> tuple[Callable, Tensor, float]:
        """Get the graph of ``function(model, *args)`` and make its first call: (the graph, its
        result, seconds). On a CPU the graph is loaded whole when saved, else built ahead of
        time and saved (saved_graphs.py); elsewhere, or where it cannot be saved, ``compiled()``
        (torch.compile's wrapper of it, taking ``args``) builds it in its first call. Says so
        before it compiles ``what`` (a loaded graph compiles nothing), and when it is ready,
        where it came from; if the compile cache gave a broken graph, clears the cache and
        builds it again."""

        told = False  # once per graph, though a failed export falls back to torch.compile

        def building() -> None:
            nonlocal told
            if not told:
                told = True
                self.tell(f"compiling {what} ({how_often}; {_CACHE_NOTE})")

        def make() -> tuple[Callable, str | None]:  # (the graph, where it came from)
            if self._saved is not None:
                got = saved_graphs.get(self._saved, self.model, function, args, building)
                if got is not None:
                    graph, loaded = got
                    return graph, "from the compile cache" if loaded else "compiled"
            building()  # (torch.compile may find the code in its cache: then seconds)
            return compiled(), None

        def call(graph: Callable, source: str | None) -> tuple[Tensor, str]:
            if source is not None:
                return graph(*args), source
            from torch._dynamo.utils import counters

            hits = counters["inductor"]["fxgraph_cache_hit"]
            with self._compile_settings():
                out = graph(*args)
            if counters["inductor"]["fxgraph_cache_hit"] > hits:
                return out, "traced, its code from the compile cache"
            if self._folder is not None:  # as saved_graphs.get does after it builds a graph
                compile_cache.trim(self._folder)
            return out, "compiled"

        start = time.perf_counter()
        try:
            with compile_cache.watch_loads() as failures:
                graph, source = make()
                out, source = call(graph, source)
            if failures:
                raise compile_cache.BrokenEntries(failures)
        except Exception as err:  # a cached graph that did not load, or does not run
            if not compile_cache.recover(err):
                raise
            # The process's graphs are gone: announce them again.
            self.compile_seconds.clear()
            self._graphs.clear()
            self.head_graphs.clear()
            graph, source = make()
            # A step is idempotent: it writes the same cache entries again.
            out, source = call(graph, source)
        seconds = time.perf_counter() - start
        self.tell(f"{what} is ready ({seconds:.1f} s, {source})")
        return graph, out, seconds
