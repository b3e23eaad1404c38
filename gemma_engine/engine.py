"""The engine: owns the model, its compiled decode graphs and the scheduler; generates text.

Decode reads the KV cache only up to the longest running sequence's length rounded up to a
bucket. Each (batch bucket, kv bucket) pair is one compiled graph (decode_graphs.py): shapes
inside a graph are static, so CUDA graphs apply, and a step never pays for the unused tail of
the cache beyond its bucket. Requests are queued, admitted into cache rows (slots.py) and stepped
together by the scheduler (scheduler.py), on the thread that waits for them; ``submit``
returns a handle at once, and ``generate``, ``stream`` and ``score`` are clients of the same
machinery.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import parallel, quant
from .chat_format import chat_ids
from .config import GemmaConfig
from .decode_graphs import DecodeGraphs, GraphKey
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
from .slots import batch_buckets
from .speculative import Speculator, check_speculate
from .tokenizer import IncrementalDecoder, Tokenizer

Prompt = str | list[int]


class Engine:
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
        # Told (with one line of text) when a graph starts compiling and when it is ready:
        # gemma-run prints it, so that a first call's pause is never silent.
        self.on_compile: Callable[[str], None] | None = None
        self.last_stats: dict[str, Any] = {}  # stats of the latest request, even a stream's
        self.quantization: tuple[str, int | None] | None = None  # (method, group size)
        self._source: Any = None  # the Checkpoint loaded, less its tensors (save_pretrained)
        self.checkpoint_path: Path | None = None  # where from_pretrained read the weights
        self.speculator: Speculator | None = None  # speculative decoding (speculative.py)
        # The compiled graphs (decode_graphs.py), the only place the model is compiled.
        self.graphs = DecodeGraphs(model, buckets, max_batch, self._tell) if compile else None
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
        kv_cache_dtype: str | torch.dtype | None = None,
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
        ``kv_cache_dtype`` ("float32", "bfloat16" or "float16"; default: the model's dtype)
        stores keys and values in that dtype, computing in the model's: "float16" halves an
        fp32 model's cache and the bytes attention reads per step, rounding each key and value
        to 11 significant bits (llama.cpp's default cache type).
        """
        method, draft_tokens = check_speculate(speculate, speculate_tokens)
        device = check_device(device)
        dtype = parse_dtype(dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
        check_dtype(dtype, device)
        kv_dtype = check_dtype(parse_dtype(kv_cache_dtype or dtype, "kv_cache_dtype"), device)
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
            kv_dtype=kv_dtype,
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
        engine.checkpoint_path = loaded.path
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
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype keys and values are stored in (``from_pretrained``'s ``kv_cache_dtype``)."""
        return next(b.dtype for n, b in self.model.named_buffers() if n.endswith("cache.k"))

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
        if self.graphs is None:
            return function(self.model, *args)
        return self.graphs.step(function, args)

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
        if self.graphs is None or not self.graphs.compiles_head:
            return self.model.logits(hidden)
        return self.graphs.head(hidden)

    @property
    def compile_seconds(self) -> dict[GraphKey, float]:
        """graph_key(batch bucket, kv bucket, screened) -> seconds its first call took (it
        built or loaded the graph); empty when not compiled."""
        return {} if self.graphs is None else self.graphs.compile_seconds

    def precompile(
        self, kv_lens: list[int] | None = None, batch: int = 1, greedy: bool = True
    ) -> list[int]:
        """Build now the decode graphs of ``batch`` rows for ``kv_lens`` (default: the first
        two buckets), and the quantized output layer for prompts where it is compiled, so
        that requests find them ready, in this process or, through the compile cache, in the
        next. ``greedy``: the graphs greedy requests run (the screened ones where the model has
        an int8 screen, greedy_screen.py), else those of sampled ones; with speculation, also
        its verify and draft graphs (Speculator.precompile). Call it before any
        request: it writes one position of the first ``batch`` cache rows (their prompts are
        forgotten). The kv buckets built."""
        if self.graphs is None:
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
        if self.graphs.compiles_head:  # a one-token prompt gives it its input
            self.head(self.prefill([0], 0, 0, all_positions=False))
        if self.speculator is not None:  # and the graphs a speculative step runs
            self.speculator.precompile(kv_lens, greedy)
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
