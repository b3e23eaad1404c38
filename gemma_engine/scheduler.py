"""The scheduler: which requests run in the next step, and which thread runs the model.

Each step, between model calls:
1. drops cancelled requests (a running one frees its slot; a queued one just leaves the queue);
2. admits the first waiting request into a free slot (reusing the longest cached prefix, see
   slots.py) if no other prompt is being prefilled;
3. runs one chunk of that prompt (at most ``engine.prefill_chunk`` tokens), so a long prompt
   holds the running streams back by one chunk per step, never by the whole prompt;
4. runs one batched decode step for every running request (the one whose prompt just finished
   included), padded up to a batch bucket.

Who drives: the caller. A thread waiting on a request (``Request.result()``, iterating it, and
so ``Engine.generate``/``stream``/``score``) runs steps itself while no other thread does, for
every request in flight, and hands over when its own request ends; a server runs
``run_forever`` on one thread instead. ``submit`` and ``Request.cancel`` are safe from any
thread. Why not a background thread: OpenMP (PyTorch's CPU threads) keeps one worker pool per
thread that starts parallel work, and once two such threads exist on a machine with no spare
core, libgomp stops spinning at its barriers and every parallel region sleeps and wakes (about
110 context switches a step here): the default model's int8 step went from 15-17 ms on the
thread that had loaded it to 21-27 ms on a second thread (BENCHMARKS.md). Driving on the
caller's thread keeps the model on the thread that loaded it, and leaves no thread behind at
exit.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from .request import Request
from .sampling import sample_rows, token_logprobs
from .slots import SlotTable, batch_buckets

if TYPE_CHECKING:
    from .engine import Engine


class Scheduler:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        cfg = engine.config
        window = cfg.sliding_window if cfg.has_sliding_layers else None
        self.slots = SlotTable(engine.max_batch, engine.max_seq_len, window, engine.model.ring)
        self.batch_sizes = batch_buckets(engine.max_batch)
        self._lock = threading.Lock()  # the queues below, between submitters and the driver
        self._waiting: deque[Request] = deque()
        self._prefilling: Request | None = None
        self._running: list[Request] = []
        self._forget = False  # clear_cache was called: idle slots drop their prompts
        self._driving = threading.Lock()  # held by the thread running steps
        self._work = threading.Event()  # set on submit, for run_forever to wake up

    def submit(self, request: Request) -> None:
        request.advance = self.advance
        with self._lock:
            self._waiting.append(request)
        self._work.set()

    def clear_cache(self) -> None:
        """Forget the prompts idle slots hold (no later request reuses them); takes effect
        before the next admission."""
        with self._lock:
            self._forget = True

    def _forget_idle(self) -> None:
        for slot in self.slots.slots:
            if not slot.busy:
                self.slots.reset(slot)
        self._forget = False

    def load(self) -> tuple[int, int]:
        """(requests waiting for a slot, slots held by a request), from any thread."""
        with self._lock:
            waiting = len(self._waiting)
        return waiting, sum(s.busy for s in self.slots.slots)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._prefilling or self._running)

    # -- driving -----------------------------------------------------------------------------
    def advance(self, wait: float = 0.005) -> None:
        """Make progress for whoever waits: run one step if no other thread is running steps,
        else wait up to ``wait`` seconds for that thread (the caller then checks its request)."""
        if not self._driving.acquire(timeout=wait):
            return
        try:
            if self.busy():
                self._step_or_fail()
        finally:
            self._driving.release()

    def run_forever(self, stop: threading.Event) -> None:
        """Run steps on this thread until ``stop`` is set, sleeping while there is no work
        (a server's engine thread). Other threads' waits then only wait."""
        with self._driving:
            while not stop.is_set():
                if not self.busy():
                    self._work.wait(0.1)
                    self._work.clear()
                    continue
                self._step_or_fail()

    def _step_or_fail(self) -> None:
        with torch.no_grad():  # grad mode is thread-local, and part of a graph's guards
            try:
                self.step()
            except BaseException as err:  # fail what was in flight; the engine goes on
                self._fail_in_flight(err)
                if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit
                    raise

    def batch_size(self, n: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> None:
        with self._lock:
            if self._forget:
                self._forget_idle()
        self._drop_cancelled()
        if self._prefilling is None:
            self._admit()
        if self._prefilling is not None:
            self._prefill_chunk(self._prefilling)
        if self._running:
            self._decode()

    def _drop_cancelled(self) -> None:
        with self._lock:
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                request.complete("cancelled")
        for request in [r for r in (self._prefilling, *self._running) if r and r.cancelled]:
            self._finish(request, "cancelled")

    def _admit(self) -> None:
        with self._lock:
            if not self._waiting or not self.slots.free():
                return
            request = self._waiting.popleft()
        slot, cached = self.slots.acquire(request.ids, reuse=not request.score)
        request.slot, request.prefilled = slot, cached
        request.stats["cached_tokens"] = cached
        request.started = time.perf_counter()
        request.graphs_before = set(self.engine.compile_seconds)
        self._prefilling = request

    def _prefill_chunk(self, request: Request) -> None:
        engine = self.engine
        start = request.prefilled
        end = min(start + engine.prefill_chunk, len(request.ids))
        chunk = request.ids[start:end]
        hidden = engine.prefill(chunk, start, request.slot.index, all_positions=request.score)
        self.slots.wrote(request.slot, chunk, start)
        request.prefilled = end
        if request.score:
            request.logits.append(engine.model.logits(hidden)[0].float().cpu())
        if end < len(request.ids):
            return
        if request.score:
            self._finish(request)
            return
        logits = engine.head(hidden)[:, -1]  # (1, vocab)
        token = engine.agree(sample_rows(logits, [request.params], [request.generator]))
        self._record_logprobs([request], logits, token)
        first = int(token.item())
        # Prefilling until here: if anything above raised, the request is failed with the
        # error and its slot reset (_fail_in_flight), instead of waiting forever.
        self._prefilling = None
        request.stats["prefill_seconds"] = time.perf_counter() - request.started
        if request.accept(first, engine.eos_token_ids):
            self._finish(request)
        else:
            self._running.append(request)

    def _decode(self) -> None:
        engine = self.engine
        if engine.speculator is not None and engine.speculator.decode(self):
            return  # a speculative step (speculative.py): one request, drafts verified
        live = list(self._running)
        n = len(live)
        positions = [r.position for r in live]
        kv_live = engine.bucket_for(max(positions) + 1)
        prefilling = self._prefilling.slot if self._prefilling is not None else None
        pads = self.slots.pads(self.batch_size(n) - n, kv_live, prefilling)
        positions += [pos for _, pos in pads]
        kv_len = engine.bucket_for(max(positions) + 1)
        device = engine.device
        tokens = torch.tensor([[r.token] for r in live] + [[0]] * len(pads), device=device)
        input_pos = torch.tensor(positions, device=device)[:, None]  # (B, 1)
        rows = torch.tensor(
            [r.slot.index for r in live] + [s.index for s, _ in pads], device=device
        )
        # Greedy rows that want no logprobs need only the argmax: the int8 screen's graph
        # finds it without reading the float output layer (greedy_screen.py).
        screened = engine.screens and all(r.params.greedy and r.logprobs is None for r in live)
        fresh = engine.graphs is not None and not engine.graphs.built(len(rows), kv_len, screened)
        start = time.perf_counter()
        if screened:
            sampled = engine.greedy_step(tokens, input_pos, kv_len, rows)[:n]
        else:
            logits = engine.step(tokens, input_pos, kv_len, rows)[:n, -1]  # (n, vocab)
            sampled = sample_rows(logits, [r.params for r in live], [r.generator for r in live])
            sampled = engine.agree(sampled)
            self._record_logprobs(live, logits, sampled)
        values = sampled.tolist()
        seconds = time.perf_counter() - start
        for request, value in zip(live, values, strict=True):
            self.slots.wrote(request.slot, [request.token], request.position)
            stats = request.stats
            if not stats["buckets_used"] or stats["buckets_used"][-1] != kv_len:
                stats["buckets_used"].append(kv_len)
            if not fresh:  # a step that compiled a graph is not decode speed
                stats["decode_seconds"] += seconds
                stats["decode_tokens"] += 1
            if request.accept(value, engine.eos_token_ids):
                self._finish(request)

    @staticmethod
    def _record_logprobs(requests: list[Request], logits: torch.Tensor, tokens: torch.Tensor):
        """The sampled tokens' logprobs, for the requests that asked (before ``accept``, so
        that a piece of text is never ahead of its tokens' logprobs)."""
        rows = [i for i, r in enumerate(requests) if r.logprobs is not None]
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        tops = [requests[i].top_logprobs for i in rows]
        for i, entry in zip(rows, token_logprobs(logits[index], tokens[index], tops), strict=True):
            requests[i].logprobs.append(entry)

    def _finish(self, request: Request, reason: str | None = None) -> None:
        """Free the request's slot (idle: it keeps its tokens) and hand over the result."""
        if request is self._prefilling:
            self._prefilling = None
        if request in self._running:
            self._running.remove(request)
        if request.slot is not None:
            self.slots.release(request.slot)
        stats = request.stats
        pairs = sorted(set(self.engine.compile_seconds) - request.graphs_before)
        stats["graphs_compiled"] = pairs
        stats["buckets_compiled"] = sorted({key[1] for key in pairs})
        stats["compile_seconds"] = sum(self.engine.compile_seconds[p] for p in pairs)
        seconds = stats["decode_seconds"]
        stats["decode_tokens_per_second"] = stats["decode_tokens"] / seconds if seconds else None
        request.complete(reason)

    def _fail_in_flight(self, error: BaseException) -> None:
        for request in [r for r in (self._prefilling, *self._running) if r is not None]:
            if request.slot is not None:
                self.slots.reset(request.slot)  # what the failed step wrote is unknown
            request.fail(error)
        self._prefilling, self._running = None, []
