"""The engine: loads a checkpoint, owns the compiled decode graphs, and generates text.

Decode reads the KV cache only up to the current length rounded up to a bucket. Each bucket is
one compiled graph (``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``):
shapes inside a graph are static, so CUDA graphs apply, and a step never pays for the unused
tail of the cache beyond its bucket.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import cpu, quant
from .config import AttentionType, GemmaConfig
from .errors import InvalidRequestError, OutOfMemoryError
from .inputs import (
    check_device,
    check_dtype,
    check_generation_args,
    check_token_ids,
    parse_dtype,  # noqa: F401  (also imported from here by scripts)
)
from .loading import build_model, read_checkpoint, resolve
from .model import GemmaForCausalLM
from .sampling import SamplingParams, sample
from .tokenizer import IncrementalDecoder, Tokenizer

# Longest cache allocated when the caller does not ask: long enough for real use on a laptop,
# and a 32k-position model's global layers would otherwise reserve memory nobody uses.
DEFAULT_MAX_SEQ_LEN = 8192
# Buckets double from here. Below a few hundred positions attention is a sliver of a step's
# cost, while every bucket costs a compile; doubling wastes at most half of a step's cache read
# and keeps the number of graphs logarithmic (6 up to 8192).
FIRST_BUCKET = 256
# Prompts are prefilled in chunks of this many tokens, which bounds the attention scores'
# memory; the prefill runs eagerly because prompt lengths vary and its matmuls are already large.
PREFILL_CHUNK = 512

Prompt = str | list[int]


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # new tokens only, an EOS token included when one ended the text
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: dict[str, Any] = field(default_factory=dict)


def default_buckets(max_seq_len: int) -> list[int]:
    buckets, n = [], FIRST_BUCKET
    while n < max_seq_len:
        buckets.append(n)
        n *= 2
    return [*buckets, max_seq_len]


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
    ) -> None:
        self.model = model
        self.config: GemmaConfig = model.config
        self.tokenizer = tokenizer
        self.max_seq_len = model.max_seq_len
        self.buckets = buckets
        self.eos_token_ids = eos_token_ids
        self.device = model.model.embed_tokens.weight.device
        self.compile = compile
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds its first call took
        self.last_stats: dict[str, Any] = {}  # stats of the latest generation, even a stream's
        self.quantization: tuple[str, int | None] | None = None  # (method, group size)
        self._source: Any = None  # the Checkpoint loaded, less its tensors (save_pretrained)
        self.overlap_steps = self.device.type == "cuda"  # see _token_stream
        if compile:
            cpu.isolate_compile_cache()
            # One graph per bucket: kv_len is a Python int, so each new value compiles once.
            # Dynamo counts graphs per code object, shared by every engine in the process, so
            # the limit grows by this engine's buckets.
            Engine._graphs_allowed += len(buckets)
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, Engine._graphs_allowed)
            dynamo.accumulated_recompile_limit = max(
                dynamo.accumulated_recompile_limit, Engine._graphs_allowed
            )
            for layer in model.model.layers:  # CUDA graphs may keep these addresses fixed
                if (cache := layer.self_attn.cache) is not None:  # KV-shared layers have none
                    torch._dynamo.mark_static_address(cache.k)
                    torch._dynamo.mark_static_address(cache.v)
            self._compiled = torch.compile(
                model, mode="reduce-overhead", fullgraph=True, dynamic=False
            )
        self._head = model.logits
        if compile and not isinstance(model.model.embed_tokens, torch.nn.Embedding):
            # A prompt's layers run eagerly (lengths vary, the matmuls are large), but its one
            # row of logits is a product with the whole output matrix, which eagerly would
            # expand a quantized matrix in full (seconds). Compiled, it streams the quantized
            # bytes as decode does. Float weights keep MKL's GEMV here: tens of milliseconds,
            # against a compile of up to 12 s before a fresh process's first token.
            self._head = torch.compile(model.logits, fullgraph=True, dynamic=False)

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
    ) -> Engine:
        """Load ``model`` (a folder, a .gguf file, a hub id, or None for the default model).

        ``quantize`` ("none", "int8" or "int4", with ``group_size`` for int4) stores the
        weights in fewer bits (see quant.py); a checkpoint saved by ``save_pretrained`` after
        quantizing loads as it was saved.
        """
        device = check_device(device)
        dtype = parse_dtype(dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
        check_dtype(dtype, device)
        ckpt = read_checkpoint(resolve(model), dtype)
        config = GemmaConfig.from_hf(ckpt.config)
        with torch.device("meta"):  # the layers quantization would replace, with no weights
            skeleton = GemmaForCausalLM(config)
        method, group_size = quant.check_quantize(
            quantize, group_size, quant.input_widths(skeleton)
        )
        quant.check_supported(skeleton, method)
        saved = ckpt.config.get(quant.CONFIG_KEY)
        if saved and method not in ("none", saved["method"]):
            raise InvalidRequestError(
                f"this checkpoint is already quantized ({saved['method']}); load it without "
                "quantize, or quantize from the original weights"
            )
        max_seq_len = _check_max_seq_len(max_seq_len, config)
        buckets = _check_buckets(buckets, max_seq_len)
        _check_cache_fits(config, max_seq_len, dtype, device)
        tokenizer = Tokenizer(ckpt.tokenizer_model)
        tokenizer.check_fits(config.vocab_size)
        if saved:
            quantized = (saved["method"], saved.get("group_size"))
            net = build_model(config, ckpt.tensors, device, dtype, quantized)
        else:
            net = build_model(config, ckpt.tensors, device, dtype)
            if method != "none":
                quant.quantize_model(net, method, group_size, dtype)
                quantized = (method, group_size)
            else:
                quantized = None
        del ckpt.tensors  # the model holds what it needs
        if quantized is not None:
            if device.type == "cpu":
                quant.to_kernel_layout(net)
            quant.warn_if_slow(quantized[0], device)
        net.setup_cache(max_seq_len)
        eos = set(config.eos_token_ids)
        gen_eos = ckpt.generation_config.get("eos_token_id")
        eos.update(
            gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        )
        for end in ("<end_of_turn>", "<turn|>"):  # a finished turn ends the text, as in HF
            if tokenizer.has_piece(end):
                eos.add(tokenizer.special_id(end))
        engine = cls(
            net,
            tokenizer,
            compile=True if compile is None else compile,
            buckets=buckets,
            eos_token_ids=eos,
        )
        engine.quantization = quantized
        engine._source = ckpt  # config and tokenizer, for save_pretrained
        return engine

    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """Write the model as a checkpoint folder (safetensors), quantized weights as they are.

        The folder is written under a temporary name and renamed when complete; an existing
        folder is refused rather than overwritten.
        """
        from safetensors.torch import save_file

        folder = Path(folder).expanduser()
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

    # -- the decode step ------------------------------------------------------------------
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
    def step(self, tokens: Tensor, input_pos: Tensor, kv_len: int) -> Tensor:
        """One decode step through the graph of bucket ``kv_len`` (eager when not compiled)."""
        if not self.compile:
            return self.model(tokens, input_pos, kv_len)
        start = time.perf_counter()
        with cpu.compile_config():
            logits = self._compiled(tokens, input_pos, kv_len)
        self.compile_seconds.setdefault(kv_len, time.perf_counter() - start)  # first call compiles
        return logits

    def _prefill(self, ids: list[int]) -> Tensor:
        tokens = torch.tensor([ids], device=self.device)
        for start in range(0, len(ids), PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, len(ids))
            pos = torch.arange(start, end, device=self.device)
            hidden = self.model.hidden(tokens[:, start:end], pos, self.bucket_for(end))
        with cpu.compile_config():
            return self._head(hidden)[:, -1]  # (1, vocab)

    def _token_stream(
        self, ids: list[int], max_new_tokens: int, params: SamplingParams, stats: dict[str, Any]
    ) -> Iterator[int]:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        start = time.perf_counter()
        token = sample(self._prefill(ids), params, generator)  # (1,)
        first = token.item()
        stats["prefill_seconds"] = time.perf_counter() - start
        stats.update(decode_tokens=0, decode_seconds=0.0, buckets_used=[])
        yield first
        # The last sampled token is fed only if another one follows, so a full cache can still
        # yield one more token than it has slots left.
        steps = min(max_new_tokens, self.max_seq_len - len(ids) + 1) - 1
        input_pos = torch.tensor([len(ids)], device=self.device)
        used = stats["buckets_used"]
        # On a GPU, step i+1 is queued before token i is read back, so the device never waits
        # for the host between steps (tokens are sampled on the device and fed back there);
        # the price is one step computed after an EOS. On CPU there is nothing to overlap.
        lag = 1 if self.overlap_steps else 0
        in_flight: list[tuple[Tensor, Any]] = []
        for i in range(steps):
            kv_len = self.bucket_for(len(ids) + i + 1)
            if not used or used[-1] != kv_len:
                used.append(kv_len)
            fresh = self.compile and kv_len not in self.compile_seconds
            t0 = time.perf_counter()
            logits = self.step(token.view(1, 1), input_pos, kv_len)[:, -1]
            token = sample(logits, params, generator)
            input_pos += 1
            in_flight.append(_to_host(token))
            if len(in_flight) > lag:
                value = _read(in_flight.pop(0))  # the host waits here, for an earlier step
                if not fresh:  # a step that compiled a graph is not decode speed
                    stats["decode_seconds"] += time.perf_counter() - t0
                    stats["decode_tokens"] += 1
                yield value
        for item in in_flight:
            yield _read(item)

    # -- the public API ---------------------------------------------------------------------
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
    ) -> Generation | list[Generation]:
        """Generate a continuation of ``prompt``; a list of strings gives a list of results."""
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
        )
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.generate(p, **kwargs) for p in prompt]
        run = self._run(prompt, **kwargs)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[str]:
        """Yield the text of a generation piece by piece, as it is decoded."""
        yield from self._run(prompt, **kwargs)

    def score(self, token_ids: list[int]) -> Tensor:
        """float32 logits (len(token_ids), vocab) of one forward pass over the sequence."""
        ids = self._prompt_ids(token_ids)
        tokens = torch.tensor([ids], device=self.device)
        pos = torch.arange(len(ids), device=self.device)
        with torch.no_grad():
            logits = self.model(tokens, pos, self.bucket_for(len(ids)), all_logits=True)
        return logits[0].float().cpu()

    def chat_prompt(self, message: str, system: str | None = None) -> list[int]:
        """Token ids of ``message`` as a user turn of the model's chat template, ready for a reply.

        Gemma 4 has its own turn markers and a system role; Gemma 1-3n put a system prompt at
        the start of the first user turn, as their templates do. The turn markers are inserted
        by id, never parsed out of the text, so user text cannot open or close a turn.
        """
        tok = self.tokenizer

        def text(s: str) -> list[int]:
            return tok.encode(s, add_bos=False)

        system_turn: list[int] = []
        if self.config.model_type == "gemma4_text":
            start, end = tok.special_id("<|turn>"), tok.special_id("<turn|>")
            if system is not None:
                system_turn = [start, *text(f"system\n{system}"), end, *text("\n")]
        else:
            start, end = tok.special_id("<start_of_turn>"), tok.special_id("<end_of_turn>")
            if system is not None:
                message = f"{system}\n\n{message}"
        return [
            tok.bos_id,
            *system_turn,
            start,
            *text(f"user\n{message}"),
            end,
            *text("\n"),
            start,
            *text("model\n"),
        ]

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

    def _run(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
    ) -> Iterator[str]:
        params = SamplingParams(temperature, top_k, top_p, seed)
        max_new_tokens, stops = check_generation_args(max_new_tokens, stop)
        ids = self._prompt_ids(prompt)
        stats: dict[str, Any] = {"prompt_tokens": len(ids)}
        self.last_stats = stats
        decoder = IncrementalDecoder(self.tokenizer, ids)
        compiled_before = set(self.compile_seconds)
        new_ids: list[int] = []
        pieces: list[str] = []
        pending, finish, hit = "", "length", False
        with torch.no_grad():
            for token in self._token_stream(ids, max_new_tokens, params, stats):
                new_ids.append(token)
                if token in self.eos_token_ids:
                    finish = "stop"
                    break
                pending += decoder.push(token)
                ready, pending, hit = _split_at_stop(pending, stops)
                if ready:
                    pieces.append(ready)
                    yield ready
                if hit:
                    finish = "stop"
                    break
        tail = "" if hit else pending + decoder.flush()
        if tail:
            pieces.append(tail)
            yield tail
        stats["buckets_compiled"] = sorted(set(self.compile_seconds) - compiled_before)
        stats["compile_seconds"] = sum(self.compile_seconds[b] for b in stats["buckets_compiled"])
        seconds = stats["decode_seconds"]
        stats["decode_tokens_per_second"] = stats["decode_tokens"] / seconds if seconds else None
        return Generation("".join(pieces), new_ids, finish, stats)


def _to_host(token: Tensor) -> tuple[Tensor, Any]:
    """Start copying a sampled token id to the host; (host tensor, event marking its arrival)."""
    if token.device.type != "cuda":
        return token, None
    host = token.to("cpu", non_blocking=True)  # pinned, asynchronous
    done = torch.cuda.Event()
    done.record()
    return host, done


def _read(item: tuple[Tensor, Any]) -> int:
    host, done = item
    if done is not None:
        done.synchronize()
    return int(host.item())


def _split_at_stop(text: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text to hold back, whether a stop string was found)."""
    if not stops:
        return text, "", False
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], "", True
    # Hold back the longest tail that could still grow into a stop string.
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold], text[len(text) - hold :], False


def _check_max_seq_len(max_seq_len: int | None, config: GemmaConfig) -> int:
    limit = config.max_position_embeddings
    if max_seq_len is None:
        return min(limit, DEFAULT_MAX_SEQ_LEN)
    if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= limit:
        raise InvalidRequestError(
            f"max_seq_len must be a whole number from 1 to {limit} (the "
            f"model's max_position_embeddings), got {max_seq_len!r}"
        )
    return max_seq_len


def _check_buckets(buckets: list[int] | None, max_seq_len: int) -> list[int]:
    if buckets is None:
        return default_buckets(max_seq_len)
    if not buckets or not all(isinstance(b, int) and 1 <= b <= max_seq_len for b in buckets):
        raise InvalidRequestError(
            f"buckets must be whole numbers from 1 to max_seq_len ({max_seq_len}), got {buckets!r}"
        )
    return sorted(set(buckets) | {max_seq_len})


def _check_cache_fits(
    config: GemmaConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device
) -> None:
    window = config.sliding_window or max_seq_len
    need = 0
    for i, (spec, kind) in enumerate(zip(config.layers, config.layer_types, strict=True)):
        if spec.kv_source != i:  # a KV-shared layer reads another layer's cache
            continue
        slots = min(window, max_seq_len) if kind is AttentionType.SLIDING else max_seq_len
        need += 2 * slots * spec.num_key_value_heads * spec.head_dim * dtype.itemsize
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * free:
        raise OutOfMemoryError(
            f"a KV cache of {max_seq_len} positions needs {need / 2**30:.1f} GiB but only "
            f"{free / 2**30:.1f} GiB is free on {device}; pass a smaller max_seq_len "
            "(--max-seq-len)"
        )
