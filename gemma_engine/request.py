"""A request: what was asked, its state while the scheduler runs it, and the caller's handle.

``Engine.submit`` returns a ``Request`` at once. The caller iterates it for text pieces as they
are decoded, calls ``cancel()``, or blocks in ``result()`` for the ``Generation``. The
thread that waits on it drives the engine (see scheduler.py); every method here is safe to call
from any thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .sampling import SamplingParams, TokenLogprob
from .tokenizer import IncrementalDecoder


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # new tokens only, an EOS token included when one ended the text
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "cancelled"
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked


class Request:
    """A handle on one generation (or, internally, one scoring pass) in the engine's queue."""

    def __init__(
        self,
        ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        stops: list[str],
        decoder: IncrementalDecoder,
        *,
        limit: int,
        device: torch.device,
        score: bool = False,
        top_logprobs: int | None = None,
    ) -> None:
        self.ids = ids
        self.params = params
        self.stops = stops
        self.score = score  # all positions' logits, no generation
        # None: no logprobs; k: each new token's logprob and its k likeliest alternatives
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] | None = None if top_logprobs is None else []
        self.submitted = time.perf_counter()
        self.token_times: list[float] = []  # perf_counter when each new token was sampled
        # Called on the engine's thread after each piece (and at the end) is queued, so that
        # a caller on an event loop can wait without a thread (the server).
        self.on_update: Callable[[], None] | None = None
        self.limit = min(max_new_tokens, limit)  # tokens it may produce (the cache ends)
        self.stats: dict[str, Any] = {
            "prompt_tokens": len(ids),
            "cached_tokens": 0,
            "decode_tokens": 0,
            "decode_seconds": 0.0,
            "buckets_used": [],
            # speculative decoding (speculative.py): tokens drafted, and those the model kept
            "drafted_tokens": 0,
            "accepted_tokens": 0,
            "draft_prefill_seconds": 0.0,  # an int8 draft's own prefill of the prompt
        }
        self.generator = None
        if params.seed is not None:  # its own generator: the same draws whatever the batch
            self.generator = torch.Generator(device).manual_seed(params.seed)
        self.advance: Any = None  # set by Scheduler.submit: run or wait for one step
        # Scheduler state (touched only by the thread running steps).
        self.slot: Any = None  # slots.Slot while it holds one
        self.prefilled = 0  # prompt positions in the cache
        self.token: int | None = None  # the last token sampled, fed at the next step
        self.new_ids: list[int] = []
        self.draft_state: Any = None  # a speculative drafter's per-request state
        self.logits: list[Tensor] = []  # score: float32 logits per prompt chunk
        self.started = 0.0  # perf_counter when admitted
        self.graphs_before: set[tuple[int, int]] = set()
        self._decoder = decoder
        self._pending = ""  # text held back while it may still become a stop string
        self._text: list[str] = []
        # Handle state.
        # (text piece, how many new tokens it completes), None at the end
        self._pieces: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._drained = False  # ready() has seen the end
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._result: Generation | Tensor | None = None
        self._error: BaseException | None = None

    # -- the caller's side ---------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        """Text pieces as they are decoded; ends when the request does (re-raises its error)."""
        while True:
            try:
                item = self._pieces.get_nowait()
            except queue.Empty:
                self.advance()
                continue
            if item is None:
                break
            yield item[0]
        if self._error is not None:
            raise self._error

    def ready(self) -> tuple[list[tuple[str, int]], bool]:
        """Without waiting: the pieces decoded since the last call, each with the number of new
        tokens decoded up to it, and whether the request has ended (then ``result()`` does not
        block). For a caller that does not drive the engine (a server running ``run_forever``)
        and waits for ``on_update`` instead."""
        out = []
        while not self._drained:
            try:
                item = self._pieces.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._drained = True
            else:
                out.append(item)
        return out, self._drained

    def cancel(self) -> None:
        """Stop generating: the scheduler frees the slot at its next step (a queued request is
        dropped). ``result()`` then gives the text so far, finish_reason "cancelled"."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Generation:
        """Block until the request ends; its Generation (or the error that ended it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the request did not finish within {timeout} s")
            self.advance()
        if self._error is not None:
            raise self._error
        return self._result

    # -- the scheduler's side ------------------------------------------------------------
    @property
    def position(self) -> int:
        """Where the next token fed to the model goes."""
        return len(self.ids) + len(self.new_ids) - 1

    def accept(self, token: int, eos: set[int]) -> bool:
        """Take a sampled token; emit the text it completes. True if the request is done."""
        self.new_ids.append(token)
        self.token = token
        self.token_times.append(time.perf_counter())
        if token in eos:
            return self._finish("stop", hit=False)
        self._pending += self._decoder.push(token)
        ready, self._pending, hit = split_at_stop(self._pending, self.stops)
        self._emit(ready)
        if hit:
            return self._finish("stop", hit=True)
        if len(self.new_ids) >= self.limit:
            return self._finish("length", hit=False)
        return False

    def _emit(self, piece: str) -> None:
        if piece:
            self._text.append(piece)
            self._pieces.put((piece, len(self.new_ids)))
            self._notify()

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update()

    def _finish(self, reason: str, hit: bool) -> bool:
        if not hit:
            self._emit(self._pending + self._decoder.flush())
        self._pending = ""
        self.finish_reason = reason
        return True

    def complete(self, reason: str | None = None) -> None:
        """Hand the result to the caller (stats are final by now)."""
        if self.score:
            self._result = torch.cat(self.logits)
        else:
            reason = reason or self.finish_reason
            text = "".join(self._text)
            self._result = Generation(text, self.new_ids, reason, self.stats, self.logprobs)
        self._done.set()
        self._pieces.put(None)
        self._notify()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()
        self._pieces.put(None)
        self._notify()


def split_at_stop(text: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text to hold back, whether a stop string was found)."""
    if not stops:
        return text, "", False
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], "", True
    # Hold back the longest tail that could still grow into a stop string.
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold], text[len(text) - hold :], False
