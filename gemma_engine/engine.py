"""The engine: owns the model, its compiled decode graphs and the scheduler; generates text.

Decode reads the KV cache only up to the longest running sequence's length rounded up to a
bucket. Each (batch bucket, kv bucket) pair is one compiled graph
(``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``): shapes inside a
graph are static, so CUDA graphs apply, and a step never pays for the unused tail of the cache
beyond its bucket. Requests are queued, admitted into cache rows (slots.py) and stepped
together by the scheduler (scheduler.py), on the thread that waits for them; ``submit``
returns a handle at once, and ``generate``, ``stream`` and ``score`` are clients of the same
machinery.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import compile_cache, cpu, parallel, quant, saved_graphs
from .chat_format import chat_ids
from .config import GemmaConfig
from .errors import InvalidRequestError
from .inputs import (
    check_device,
    check_dtype,
    check_generation_args,
    check_token_ids,
    parse_dtype,
    whole_number,
)
from .loading import default_buckets, load  # noqa: F401 (re-exported)
from .model import GemmaForCausalLM
from .request import Generation, Request
from .sampling import MAX_TOP_LOGPROBS, SamplingParams, greedy
from .scheduler import Scheduler
from .slots import GraphKey, batch_buckets, graph_key
from .speculative import Speculator, check_speculate
from .tokenizer import IncrementalDecoder, Tokenizer

Prompt = str | list[int]
# A graph's first call compiles it: minutes for the default model on a small CPU, the first time.
_CACHE_NOTE = "seconds when the compile cache has it, minutes the first time on a machine"


class Engine:
    _graphs_allowed = 0  # decode graphs that all compiled engines in this process may build

    def __init__(
        self,
        model: GemmaForCausalLM,
        tokenizer: Tokenizer,
        *,
        compile: bool,
        buckets: list[int],
        eos_token_ids: set[int],
        max_batch: int = 1,
        prefill_chunk: int = 512,
    ) -> None:
        """``model``'s cache must hold ``max_batch`` rows (``setup_cache``)."""
        self.model = model
        self.config: GemmaConfig = model.config
        self.tokenizer = tokenizer
        self.max_seq_len = model.max_seq_len
        self.buckets = buckets
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.eos_token_ids = eos_token_ids
        self.device = model.model.embed_tokens.weight.device
        self.compile = compile
        # (batch bucket, kv bucket) -> seconds its first call took (it compiled the graph)
        self.compile_seconds: dict[GraphKey, float] = {}
        # Told (with one line of text) when a graph starts compiling and when it is ready:
        # gemma-run prints it, so that a first call's pause is never silent.
        self.on_compile: Callable[[str], None] | None = None
        self.last_stats: dict[str, Any] = {}  # stats of the latest request, even a stream's
        self.quantization: tuple[str, int | None] | None = None  # (method, group size)
        self._source: Any = None  # the Checkpoint loaded, less its tensors (save_pretrained)
        self.speculator: Speculator | None = None  # speculative decoding (speculative.py)
        self._saved: Path | None = None  # where whole graphs are saved (saved_graphs.py)
        self._graphs: dict[GraphKey, Callable] = {}  # graph_key(...) -> its graph
        self._compiled: dict[str, Callable] = {}  # torch.compile's model (_torch_compiled)
        self._head_compiled: Callable | None = None  # and its output layer (_compiled_head)
        self._heads: dict[tuple[int, ...], Callable] = {}  # hidden's shape -> the prompt head
        if compile:
            folder = compile_cache.use()  # graphs built here are found again by the next process
            if folder is not None and self.device.type == "cpu" and model.tp is None:
                self._saved = folder
            # One graph per (batch, kv) bucket pair: shapes and kv_len are static, so each new
            # pair compiles once. Dynamo counts graphs per code object, shared by every engine
            # in the process, so the limit grows by this engine's pairs.
            # (Dynamo's and inductor's settings are per thread: step() applies them.)
            Engine._graphs_allowed += len(buckets) * len(batch_buckets(max_batch))
            if self._saved is None:  # else made only if a graph cannot be saved (Dynamo, ~1 s)
                self._torch_compiled(type(model).forward)
        self._head = model.logits
        self._head_compiles = False  # True: a prompt's logits come from compiled graphs
        head = model.output_layer()
        if compile and isinstance(head, quant.QuantizedLinear) and not head.packed:
            # A prompt's layers run eagerly (lengths vary, the matmuls are large), but its one
            # row of logits is a product with the whole output matrix, which eagerly would
            # expand a quantized matrix in full (seconds). Compiled, it streams the quantized
            # bytes as decode does. Float weights keep MKL's GEMV here: tens of milliseconds,
            # against a compile of up to 12 s before a fresh process's first token. So does an
            # int8 output layer with a library's packed copy (packed_int8.py, on x86 CPUs;
            # engines of several sequences, loading.load): ~9 ms eagerly. Without one, the
            # saved graph loads with the decode graphs (0.0 s; first token 0.16 s on a Zen 3,
            # BENCHMARKS.md 2026-12-07).
            self._head_compiles = True
        self.scheduler = Scheduler(self)

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_seq_len: int | None = None,
        compile: bool | None = None,
        buckets: list[int] | None = None,
        quantize: str | None = None,
        group_size: int | None = None,
        max_batch: int | None = None,
        prefill_chunk: int | None = None,
        speculate: str | None = None,
        speculate_tokens: int | None = None,
        greedy_screen: bool | None = None,
    ) -> Engine:
        """Load ``model`` (a folder, a .gguf file, a hub id, or None for the default model).

        ``quantize`` ("none", "int8" or "int4", with ``group_size`` for int4) stores the
        weights in fewer bits (see quant.py); a checkpoint saved by ``save_pretrained`` after
        quantizing loads as it was saved. ``max_batch`` sequences are decoded at once (default
        4, fewer if their cache would not fit); ``prefill_chunk`` (default 512) bounds how many
        prompt tokens run between two decode steps. Inside ``torchrun`` (WORLD_SIZE > 1) or
        an initialized process group, each rank loads its part of the model (tensor
        parallelism, parallel.py) and every rank must make the same calls.
        ``speculate`` ("lookup" or "int8", with ``speculate_tokens`` drafts per step,
        default 4) decodes speculatively, with the same output (see speculative.py).
        ``greedy_screen`` (default: on for CPU engines with compiled decode and a large float32
        output layer, such as the default model's) finds greedy tokens through an int8 copy of
        the output layer, with the same output (see greedy_screen.py); False turns it off.
        """
        method, draft_tokens = check_speculate(speculate, speculate_tokens)
        device = check_device(device)
        dtype = parse_dtype(dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
        check_dtype(dtype, device)
        # Inside torchrun (or a process group already set up), shard over its ranks.
        ranks, device = parallel.setup(device)
        if ranks is not None and method != "none":
            raise InvalidRequestError(
                "speculative decoding does not run under tensor parallelism yet; drop "
                "--speculate (speculate=...) or run one process"
            )
        loaded = load(
            model,
            device=device,
            dtype=dtype,
            max_seq_len=max_seq_len,
            buckets=buckets,
            quantize=quantize,
            group_size=group_size,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            ranks=ranks,
            compiled=compile is not False,
            greedy_screen=greedy_screen,
        )
        engine = cls(
            loaded.model,
            loaded.tokenizer,
            compile=True if compile is None else compile,
            buckets=loaded.buckets,
            eos_token_ids=loaded.eos_token_ids,
            max_batch=loaded.max_batch,
            prefill_chunk=loaded.prefill_chunk,
        )
        engine.quantization = loaded.quantization
        engine._source = loaded.source  # config and tokenizer, for save_pretrained
        if method != "none":
            engine.speculator = Speculator(engine, method, draft_tokens)
        return engine

    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """Write the model as a checkpoint folder (safetensors), quantized weights as they are.

        The folder is written under a temporary name and renamed when complete; an existing
        folder is refused rather than overwritten.
        """
        from safetensors.torch import save_file

        folder = Path(folder).expanduser()
        if self.model.tp is not None:
            raise InvalidRequestError(
                "save_pretrained under tensor parallelism would write one rank's slices; "
                "save the model from a single process"
            )
        if folder.exists():
            raise InvalidRequestError(f"{folder} already exists; choose a new folder")
        config = dict(self._source.config)
        config.pop(quant.CONFIG_KEY, None)
        if self.quantization is not None:
            method, group = self.quantization  # group is None for int8
            config[quant.CONFIG_KEY] = {"method": method, "group_size": group}
        tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            gen = self._source.generation_config
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            self.tokenizer.save(tmp)
            tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder

    # -- the model calls (made by the thread running steps) ---------------------------------
    def bucket_for(self, length: int) -> int:
        """The smallest bucket holding ``length`` positions."""
        return self.buckets[bisect.bisect_left(self.buckets, length)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(
            b.numel() * b.element_size()
            for name, b in self.model.named_buffers()
            if name.endswith(("cache.k", "cache.v"))
        )

    @torch.no_grad()  # grad mode is part of a graph's guards: one mode, one graph per bucket
    def step(
        self, tokens: Tensor, input_pos: Tensor, kv_len: int, rows: Tensor | None = None
    ) -> Tensor:
        """One decode step of tokens (B, 1) at positions (B,) or (B, 1) in cache rows ``rows``
        (B,), by default 0..B-1, through the graph of (B, ``kv_len``) (eager when not compiled):
        logits (B, 1, vocab).

        B should be a batch bucket (scheduler.batch_size): every other size is a graph too.
        """
        return self._step(type(self.model).forward, tokens, input_pos, kv_len, rows)

    @property
    def screens(self) -> bool:
        """Whether greedy steps read the int8 copy of the output layer (greedy_screen.py)."""
        return self.model.greedy_screen is not None

    @torch.no_grad()
    def greedy_step(
        self, tokens: Tensor, input_pos: Tensor, kv_len: int, rows: Tensor | None = None
    ) -> Tensor:
        """The greedy next tokens (B,) of the decode step ``step`` would run: the argmax of its
        logits, found through the output layer's int8 copy where the model has one (a graph of
        its own per (B, ``kv_len``), keyed (B, kv_len, "screened"))."""
        screen = self.model.greedy_screen
        if screen is None:
            return greedy(self.step(tokens, input_pos, kv_len, rows)[:, -1])
        out = self._step(type(self.model).screened, tokens, input_pos, kv_len, rows)
        softcap = self.config.final_logit_softcapping
        return screen.pick(out, self.model.output_layer().weight, softcap)

    def _step(
        self,
        function: Callable,
        tokens: Tensor,
        input_pos: Tensor,
        kv_len: int,
        rows: Tensor | None,
    ) -> Tensor:
        B = tokens.shape[0]
        input_pos = input_pos.view(B, 1)
        if rows is None:
            rows = torch.arange(B, device=tokens.device)
        for name, t in (("tokens", tokens), ("input_pos", input_pos), ("rows", rows)):
            # A graph checks its guards on its first call only (saved_graphs.Bound).
            if t.dtype != torch.long or t.device != self.device:
                raise TypeError(
                    f"Engine.step: {name} must be an int64 tensor on {self.device}, not "
                    f"{t.dtype} on {t.device}"
                )
        args = (tokens, input_pos, kv_len, rows)
        if not self.compile:
            return function(self.model, *args)
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
        limit = max(Engine._graphs_allowed, 8)
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
                self._tell(f"compiling {what} ({how_often}; {_CACHE_NOTE})")

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
            cached = counters["inductor"]["fxgraph_cache_hit"] > hits
            return out, "traced, its code from the compile cache" if cached else "compiled"

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
            self._heads.clear()
            graph, source = make()
            # A step is idempotent: it writes the same cache entries again.
            out, source = call(graph, source)
        seconds = time.perf_counter() - start
        self._tell(f"{what} is ready ({seconds:.1f} s, {source})")
        return graph, out, seconds

    def prefill(self, ids: list[int], start: int, row: int, all_positions: bool) -> Tensor:
        """Run one prompt chunk ``ids`` at positions ``start``... in cache row ``row`` (eager);
        its normed hidden states (1, T or 1, hidden)."""
        tokens = torch.tensor([ids], device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]  # (1, T)
        rows = torch.tensor([row], device=self.device)
        end = start + len(ids)
        return self.model.hidden(tokens, pos, self.bucket_for(end), rows, all_positions)

    @torch.no_grad()  # as step(): grad mode is part of a graph's guards
    def head(self, hidden: Tensor) -> Tensor:
        """Logits of the last prompt position (1, 1, vocab)."""
        if not self._head_compiles:
            return self._head(hidden)
        head = self._heads.get(tuple(hidden.shape))
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
        self._heads[tuple(hidden.shape)] = head
        return logits

    def precompile(
        self, kv_lens: list[int] | None = None, batch: int = 1, greedy: bool = True
    ) -> list[int]:
        """Build now the decode graphs of ``batch`` rows for ``kv_lens`` (default: the first
        two buckets), and the quantized output layer for prompts where it is compiled, so
        that requests find them ready, in this process or, through the compile cache, in the
        next. ``greedy``: the graphs greedy requests run (the screened ones where the model has
        an int8 screen, greedy_screen.py), else those of sampled ones. Call it before any
        request: it writes one position of the first ``batch`` cache rows (their prompts are
        forgotten). The kv buckets built."""
        if not self.compile:
            raise InvalidRequestError("precompile needs a compiled engine (compile=True)")
        kv_lens = self.buckets[:2] if kv_lens is None else sorted(set(kv_lens))
        for kv in kv_lens:
            if kv not in self.buckets:
                raise InvalidRequestError(
                    f"{kv} is not one of this engine's kv buckets {self.buckets}"
                )
        if batch not in batch_buckets(self.max_batch):
            raise InvalidRequestError(
                f"batch {batch} is not one of this engine's batch buckets "
                f"{batch_buckets(self.max_batch)}"
            )
        self.clear_cache()
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        step = self.greedy_step if greedy else self.step
        for kv in kv_lens:
            step(tokens, torch.full((batch,), kv - 1, device=self.device), kv)
        if self._head_compiles:  # a one-token prompt gives it its input
            self.head(self.prefill([0], 0, 0, all_positions=False))
        return kv_lens

    def agree(self, tokens: Tensor) -> Tensor:
        """Sampled tokens, the same on every rank: rank 0's under tensor parallelism (seeded
        generators agree anyway; the global one need not)."""
        return tokens if self.model.tp is None else self.model.tp.broadcast(tokens)

    def _tell(self, text: str) -> None:
        if self.on_compile is not None:
            self.on_compile(text)

    # -- the public API ---------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
    ) -> Request:
        """Queue a generation and return its handle at once; safe from any thread.

        Iterate the handle for text pieces, ``cancel()`` it, or ``result()`` for the
        Generation. Waiting on it runs the engine (see scheduler.py). Invalid
        arguments raise InvalidRequestError here, before anything is queued. ``logprobs=k``
        (0 to 20) records each new token's log-probability and the k likeliest tokens at its
        position (``Generation.logprobs``; the model's distribution, see sampling.py).
        """
        params = SamplingParams(temperature, top_k, top_p, seed)
        max_new_tokens, stops = check_generation_args(max_new_tokens, stop)
        if logprobs is not None:
            logprobs = whole_number(logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
        ids = self._prompt_ids(prompt)
        # The last sampled token is fed only if another one follows, so a full cache can still
        # yield one more token than it has positions left.
        limit = self.max_seq_len - len(ids) + 1
        decoder = IncrementalDecoder(self.tokenizer, ids)
        request = Request(
            ids,
            params,
            max_new_tokens,
            stops,
            decoder,
            limit=limit,
            device=self.device,
            top_logprobs=logprobs,
        )
        self.last_stats = request.stats
        self.scheduler.submit(request)
        return request

    def generate(
        self,
        prompt: Prompt | list[str],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
    ) -> Generation | list[Generation]:
        """Generate a continuation of ``prompt``; a list of strings runs as one batch (prompts
        beyond ``max_batch`` wait for a free slot) and gives a list of results."""
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            logprobs=logprobs,
        )
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            requests = [self.submit(p, **kwargs) for p in prompt]
            return [r.result() for r in requests]
        return self.submit(prompt, **kwargs).result()

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[str]:
        """Yield the text of a generation piece by piece, as it is decoded; closing the
        iterator early cancels the request."""
        request = self.submit(prompt, **kwargs)
        try:
            yield from request
        finally:
            request.cancel()  # no-op once it is done
            while not request.done:  # free its slot now: the next step drops it
                self.scheduler.advance()

    def score(self, token_ids: list[int]) -> Tensor:
        """float32 logits (len(token_ids), vocab) of one pass over the sequence (in chunks)."""
        ids = self._prompt_ids(token_ids)
        params = SamplingParams()
        decoder = IncrementalDecoder(self.tokenizer, ids)
        request = Request(ids, params, 1, [], decoder, limit=1, device=self.device, score=True)
        self.scheduler.submit(request)
        return request.result()

    def clear_cache(self) -> None:
        """Forget the prompts that idle slots keep for prefix reuse; running requests go on."""
        self.scheduler.clear_cache()

    def chat_prompt(self, message: str, system: str | None = None) -> list[int]:
        """Token ids of ``message`` as a user turn of the model's chat template, ready for a reply.

        Gemma 4 has its own turn markers and a system role; Gemma 1-3n put a system prompt at
        the start of the first user turn, as their templates do. The turn markers are inserted
        by id, never parsed out of the text, so user text cannot open or close a turn.
        """
        messages = [{"role": "user", "content": message}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return chat_ids(self.tokenizer, self.config.model_type, messages)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            ids = check_token_ids(prompt, self.config.vocab_size)
        else:
            raise InvalidRequestError("prompt must be a str, a list of token ids, or a list of str")
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if len(ids) > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but max_seq_len is {self.max_seq_len}; shorten "
                "the prompt or load the engine with a larger max_seq_len (--max-seq-len)"
            )
        return ids
