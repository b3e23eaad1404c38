"""Speculative decoding: draft a few tokens cheaply, check them all in one pass of the model.

A decode step reads every weight once per token (memory-bound on a CPU), so running k + 1
positions through the model at once costs little more than one. Each speculative step:

1. a drafter proposes up to k tokens d1..dn after the request's last token t:
   ``lookup`` copies what followed the latest earlier occurrence of the last 3 (else 2, else 1)
   tokens in the prompt and output (prompt-lookup decoding; nothing when nothing matches);
   ``int8`` runs an int8 copy of the model (quant.py) for n autoregressive steps in a cache of
   its own, its output layer cut to the common words and the context's (draft_vocabulary.py);
2. the target model runs t, d1..dn at positions p..p+n as n + 1 rows of one batched decode step
   (``Engine.step``: the same compiled graph per (rows, kv bucket) machinery as a batch of
   requests; the rows all read and write the request's own cache row, each row's mask by
   position hides the later rows' keys). A greedy request that wants no logprobs needs only
   each row's argmax: where the model screens its output layer (greedy_screen.py) the rows go
   through the screened graph (``Engine.greedy_step``), as a plain greedy step does;
3. the drafts are checked in order against the target's distribution at each position
   (``accept_drafts``): greedy keeps a draft while it equals the target's argmax, sampling
   keeps it with probability min(1, p(d)/q(d)) and otherwise draws from norm(max(0, p - q)),
   which leaves the output distributed exactly as the target's (Leviathan et al., 2023; for
   ``lookup`` q is a point mass, so a draft is kept with probability p(d)). The first rejected
   position yields the target's own token, and when all n are kept the last row gives one more:
   every step yields between 1 and n + 1 tokens.

Exactness. A verify row runs the batched decode kernels of layers.py (one read of each weight
for all rows). Their arithmetic per row is the same as a one-row step's except for the
summation order of a few reductions: inductor lays a batched product's output out as
(outputs, rows) and then vectorizes the following norm's sum over the rows instead of along
the hidden size, so a row's logits differ from a one-row step's by rounding (about 1e-6 on the
tiny test models), exactly as a request decoded in a batch of two already differs from the same
request alone (eager, MKL's GEMM against its GEMV, likewise). Greedy output is therefore
token-identical to the engine without speculation in the same sense that batched decode is to
solo decode: the tests check tokens and a logit tolerance against plain steps.

Stale keys. Rejected drafts leave keys in the cache beyond the accepted length; every mask
compares positions, so a global layer never reads them and they are overwritten when those
positions are decoded for real. A sliding layer's ring holds the window and min(prefill_chunk,
model.RING_SLACK) more entries (model.KVCache): that many positions can be written before they
are read. A verify step writes k + 1 positions at once, so the engine requires k + 1 <=
prefill_chunk (k is at most 16, the slack 32). Then writing p..p+k evicts only positions
outside the window of every query at p or later, and a stale key at p + j (j <= k) sits in the
ring entry of position p + j - ring, which the mask places outside the window of any later
query. (The
int8 drafter writes fewer positions ahead than the target.) ``slots.Slot.written`` counts
the speculative writes, so the prefix-reuse rule of slots.py stays correct.

Scope. Speculation runs while exactly one request is decoding (a chat, a CLI run, one client);
with two or more the scheduler takes its usual batched step, which already reads each weight
once for all of them. The int8 drafter keeps one cache row and re-synchronizes it with the
request it drafts for by common prefix (rolling back rejected drafts the same way).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import draft_vocabulary
from .decode_graphs import DecodeGraphs
from .errors import InvalidRequestError
from .inputs import whole_number
from .sampling import greedy, probabilities
from .slots import common_prefix

if TYPE_CHECKING:
    from .engine import Engine
    from .request import Request
    from .scheduler import Scheduler

METHODS = ("none", "lookup", "int8")
DEFAULT_TOKENS = 4  # k: drafts per step (the note's model: 1.65x at acceptance 0.6)
MAX_TOKENS = 16  # more rows cost compute that acceptance rarely repays on a CPU
MAX_NGRAM = 3  # lookup tries the last 3 tokens, then 2, then 1


def check_speculate(speculate: str | None, tokens: int | None) -> tuple[str, int]:
    """(method, k) from the caller's arguments, before anything is loaded."""
    method = "none" if speculate is None else speculate
    if not isinstance(method, str) or method not in METHODS:
        raise InvalidRequestError(
            f"speculate must be one of {', '.join(METHODS)} (or None), got {speculate!r}"
        )
    if method == "none":
        if tokens is not None:
            raise InvalidRequestError(
                "speculate_tokens was given without speculate; pass speculate='lookup' or "
                "'int8' (--speculate) as well"
            )
        return method, 0
    k = (
        DEFAULT_TOKENS
        if tokens is None
        else whole_number(tokens, "speculate_tokens", 1, MAX_TOKENS)
    )
    return method, k


# -- drafters ---------------------------------------------------------------------------------
class NgramIndex:
    """Where each 1..3-gram of a token sequence last ended, for prompt-lookup drafting.

    Only occurrences ending before the last token are indexed, so a lookup of the sequence's
    own suffix finds the latest *earlier* match; extended as tokens are appended (never rolled
    back: only accepted tokens are in a request's context).
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # positions whose n-grams (ending there) are in last_end

    def extend(self, context: list[int]) -> None:
        assert context[: len(self.tokens)] == self.tokens[: len(context)], "context only grows"
        self.tokens = list(context)
        for end in range(self.indexed, len(self.tokens) - 1):
            for n in range(1, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self.last_end[tuple(self.tokens[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, len(self.tokens) - 1)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix seen before; [] when none was."""
        tokens = self.tokens
        for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class LookupDrafter:
    """Prompt-lookup decoding: drafts are copies from the request's own prompt and output."""

    name = "lookup"
    prefill_seconds = 0.0  # it has no cache of its own to catch up

    def draft(self, request: Request, k: int) -> tuple[list[int], Tensor | None]:
        if request.draft_state is None:
            request.draft_state = NgramIndex()
        index: NgramIndex = request.draft_state
        index.extend(request.ids + request.new_ids)
        return index.draft(k), None  # a point mass: no draft distribution


class Int8Drafter:
    """An int8 copy of the target model (quant.py) drafting autoregressively.

    It shares the target's tokenizer, config and its norm weights (the same tensors); its
    quantized matrices are its own (a quarter of fp32's bytes), and so is its one-row cache.
    Its output layer holds only the rows of ``words`` common ids and of the context's tokens
    (draft_vocabulary.py; None: the whole vocabulary).
    ``self.tokens`` are the positions its cache holds; a draft first brings them in line with
    the request's context by common prefix (which is also how rejected drafts are rolled
    back), prefilling a long gap eagerly and feeding one or two missing tokens through its
    compiled step.
    """

    name = "int8"

    def __init__(self, engine: Engine, words: int | None = draft_vocabulary.WORDS) -> None:
        from . import loading, quant, quantized_cache
        from .engine import Engine
        from .model import GemmaForCausalLM

        if engine.quantization is not None:
            raise InvalidRequestError(
                f"speculate='int8' drafts with an int8 copy of a float model, but this model is "
                f"already {engine.quantization[0]}; use speculate='lookup'"
            )
        target, device = engine.model, engine.device
        dtype = target.model.norm.weight.dtype
        # The int8 matrices are those `--quantize int8` makes of the same checkpoint: a CPU
        # process reads them from its quantized-weight cache entry (quantized_cache.py), where
        # the first one that quantized them kept them (~1.1 s of the default model's setup).
        path = engine.checkpoint_path
        kept = None
        if path is not None and device.type == "cpu":
            kept = quantized_cache.Entry(path, "int8", None, dtype)
        state = target.state_dict()  # norms and embeddings: the target's own tensors, shared
        model = loading.build_from_cache(kept, target.config, state, device, dtype, ("int8", None))
        if model is None:
            with torch.device("meta"):
                model = GemmaForCausalLM(target.config)
            model.load_state_dict(state, strict=True, assign=True)
            quant.quantize_model(model, "int8", None, dtype)  # new int8 matrices, norms shared
            if kept is not None:
                kept.write(quantized_cache.quantized_tensors(model))
        cfg = target.config
        self.vocab: draft_vocabulary.DraftVocabulary | None = None
        if words is not None and words < cfg.vocab_size:
            self.vocab = draft_vocabulary.DraftVocabulary(
                model.output_layer(), engine.tokenizer, words, engine.max_seq_len
            )
            model.config = dataclasses.replace(cfg, tie_word_embeddings=False)
            model.lm_head = self.vocab.head  # the embedding stays whole, for lookups
        if device.type == "cpu":
            # Compiled, it only ever steps one row, which reads the blocked matrix: the GEMM
            # library's packed copy would serve eager calls alone (without it the default
            # model's draft was set up in ~2.5 instead of ~4.3 s on an AVX2 Zen 3). Its prompts
            # go through prefill (hidden states, no logits): no compiled output layer either.
            # A partial head is written in place as contexts come, which a packed copy is not.
            packed = not engine.compile and self.vocab is None
            quant.to_kernel_layout(model, model.output_layer() if packed else None)
        model.setup_cache(engine.max_seq_len, 1, engine.prefill_chunk, engine.kv_cache_dtype)
        self.engine = Engine(
            model.eval().requires_grad_(False),
            engine.tokenizer,
            compile=engine.compile,
            buckets=engine.buckets,
            eos_token_ids=engine.eos_token_ids,
            prefill_chunk=engine.prefill_chunk,
        )
        self.engine.on_compile = lambda text: engine._tell(f"int8 draft: {text}")
        self.window = cfg.sliding_window if cfg.has_sliding_layers else None
        self.ring = model.ring
        self.tokens: list[int] = []  # what its cache row holds, positions 0..
        self.written = 0  # highest position written + 1 since it restarted at 0
        self.prefill_seconds = 0.0  # catching up on prompts (not decode time)

    def draft(self, request: Request, k: int) -> tuple[list[int], Tensor | None]:
        draft = self.engine
        context = request.ids + request.new_ids
        held, self.tokens = self.tokens, []  # unknown until this draft completes
        if self.vocab is not None:
            self.vocab.add(context)
        p = common_prefix(held, context[:-1])
        if self.window is not None and self.written - self.ring > max(0, p - self.window + 1):
            p = 0  # the ring no longer holds the window before p (see slots.py)
        if p == 0:
            self.written = 0
        if len(context) - p > 2:  # a prompt: prefill all but the last token eagerly
            start = time.perf_counter()
            for s in range(p, len(context) - 1, draft.prefill_chunk):
                chunk = context[s : min(s + draft.prefill_chunk, len(context) - 1)]
                draft.prefill(chunk, s, 0, all_positions=False)
            p = len(context) - 1
            self.prefill_seconds += time.perf_counter() - start
        feed = context[p:]  # one or two tokens: the last is the request's own
        params, generator = request.params, request.generator
        drafts: list[int] = []
        dists: list[Tensor] = []
        vocab = self.vocab
        pos = p
        while len(drafts) < k:
            token = feed[pos - p] if pos - p < len(feed) else drafts[-1]
            logits = draft.step(
                torch.tensor([[token]], device=draft.device),
                torch.tensor([pos], device=draft.device),
                draft.bucket_for(pos + 1),
            )[:, -1]  # (1, vocab)
            pos += 1
            if pos < len(context):
                continue  # a catch-up token: its logits predict a known token
            if vocab is not None:
                logits = logits + vocab.mask  # (1, head rows), spare rows -inf
            if params.greedy:
                row = int(greedy(logits))
                drafts.append(row if vocab is None else vocab.token(row))
            else:
                q = probabilities(logits, params)
                row = int(torch.multinomial(q, 1, generator=generator))
                drafts.append(row if vocab is None else vocab.token(row))
                dists.append(q[0] if vocab is None else vocab.spread(q[0]))
        self.tokens = context + drafts[:-1]  # every token fed, at positions 0..pos-1
        self.written = max(self.written, pos)
        return drafts, torch.stack(dists) if dists else None


# -- accepting and rejecting ------------------------------------------------------------------
def accept_drafts(
    p: Tensor, drafts: list[int], q: Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """The tokens a speculative step yields, sampled so that they follow the target exactly.

    ``p`` (n + 1, vocab): the target's distribution at each verified position (``probabilities``
    of the verify rows); ``drafts``: the n drafted tokens; ``q`` (n, vocab): the distribution
    each was drawn from, or None for a deterministic draft (a point mass). Draft i is kept with
    probability min(1, p(d)/q(d)); the first one rejected is replaced by a draw from
    norm(max(0, p - q)), and when all are kept a last token is drawn from p[n]. The result has
    1 to n + 1 tokens; every draw uses ``generator``, so a seeded request is reproducible.
    """
    out: list[int] = []
    for i, d in enumerate(drafts):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * qd < pd:  # u < p/q without dividing (q(d) > 0: d was drawn from q)
            out.append(d)
            continue
        point = torch.zeros_like(p[i])
        point[d] = 1.0
        residual = (p[i] - (point if q is None else q[i])).clamp(min=0)
        if not residual.sum() > 0:  # p <= q everywhere means p == q: never rejected
            residual = p[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out


def accept_greedy(logits: Tensor, drafts: list[int]) -> list[int]:
    """Greedy: the target's argmax at each position, up to and including the first that
    differs from the draft (then the drafts after it are moot)."""
    return keep_matching(greedy(logits).tolist(), drafts)


def keep_matching(best: list[int], drafts: list[int]) -> list[int]:
    """``best`` (n + 1 argmaxes) up to and including the first that differs from the draft."""
    n = next((i for i, d in enumerate(drafts) if best[i] != d), len(drafts))
    return best[: n + 1]


# -- the step ---------------------------------------------------------------------------------
class Speculator:
    """Owned by the engine; the scheduler asks it to take each decode step (``decode``)."""

    def __init__(
        self, engine: Engine, method: str, k: int, draft_words: int | None = draft_vocabulary.WORDS
    ) -> None:
        """``draft_words``: the int8 drafter's common words (draft_vocabulary.py; None: all)."""
        if k + 1 > engine.prefill_chunk:
            raise InvalidRequestError(
                f"speculate_tokens ({k}) + 1 must be at most prefill_chunk "
                f"({engine.prefill_chunk}): a sliding layer's ring keeps at most one chunk beyond "
                "its window, and a speculative step writes k + 1 positions"
            )
        self.engine = engine
        self.method = method
        self.k = k
        self.drafter = LookupDrafter() if method == "lookup" else Int8Drafter(engine, draft_words)
        if engine.compile:  # the verify graphs: k + 1 rows, one per kv bucket (and screened)
            DecodeGraphs.allow(len(engine.buckets) * (2 if engine.screens else 1))

    def decode(self, scheduler: Scheduler) -> bool:
        """One speculative step for the only running request; False (nothing done) when the
        plain step should run instead: several requests decoding, or no draft."""
        if len(scheduler._running) != 1:
            return False
        engine = self.engine
        request = scheduler._running[0]
        pos = request.position
        # Yield at most what the request may still produce, and stay inside the cache.
        n_max = min(self.k, request.limit - len(request.new_ids) - 1, engine.max_seq_len - 1 - pos)
        if n_max < 1:
            return False
        graphs = self._graphs()
        start = time.perf_counter()
        catching_up = self.drafter.prefill_seconds
        drafts, q = self.drafter.draft(request, n_max)
        # An int8 draft first prefills a new prompt into its own cache: prompt work, not decode.
        caught_up = self.drafter.prefill_seconds - catching_up
        if caught_up:
            request.stats["draft_prefill_seconds"] += caught_up
        if not drafts:
            return False
        n = len(drafts)
        fed = [request.token, *drafts]
        # k + 1 rows whatever n is (one graph per kv bucket); the spare rows repeat the last
        # one, which writes the same key and value to the same place.
        rows = fed + [fed[-1]] * (self.k - n)
        positions = list(range(pos, pos + n + 1)) + [pos + n] * (self.k - n)
        device = engine.device
        kv_len = engine.bucket_for(pos + n + 1)
        args = (
            torch.tensor(rows, device=device)[:, None],
            torch.tensor(positions, device=device),
            kv_len,
            torch.full((self.k + 1,), request.slot.index, device=device),
        )
        params = request.params
        logits = None
        if params.greedy and request.logprobs is None:  # screened where the model screens
            tokens = keep_matching(engine.greedy_step(*args)[: n + 1].tolist(), drafts)
        else:
            logits = engine.step(*args)[: n + 1, -1]  # (n + 1, vocab)
            if params.greedy:
                tokens = accept_greedy(logits, drafts)
            else:
                probs = probabilities(logits, params)
                tokens = accept_drafts(probs, drafts, q, request.generator)
        seconds = time.perf_counter() - start - caught_up
        # The cache row now holds t, d1..d(a) correctly (a = drafts kept); d(a+1).. were
        # written too and are stale until overwritten (see the module doc).
        kept = len(tokens) - 1
        scheduler.slots.wrote(request.slot, fed[: kept + 1], pos)
        request.slot.written = max(request.slot.written, pos + n + 1)
        stats = request.stats
        stats["drafted_tokens"] += n
        stats["accepted_tokens"] += kept
        if not stats["buckets_used"] or stats["buckets_used"][-1] != kv_len:
            stats["buckets_used"].append(kv_len)
        if self._graphs() == graphs:  # a step that compiled a graph is not decode speed
            stats["decode_seconds"] += seconds
            stats["decode_tokens"] += len(tokens)
        for i, token in enumerate(tokens):
            if request.logprobs is not None:
                scheduler._record_logprobs(
                    [request], logits[i : i + 1], torch.tensor([token], device=device)
                )
            if request.accept(token, engine.eos_token_ids):
                scheduler._finish(request)
                break
        return True

    def precompile(self, kv_lens: list[int], greedy: bool) -> None:
        """Build the graphs ``decode`` runs at these kv buckets: the verify step of k + 1 rows
        (the screened one for greedy requests where the model screens, else the plain one) and
        the int8 drafter's one-row step. Like Engine.precompile, it writes positions of cache
        row 0 (of the target and of the drafter) that a later request overwrites before it
        reads them."""
        engine = self.engine
        device = engine.device
        verify = engine.greedy_step if greedy else engine.step
        rows = torch.zeros(self.k + 1, dtype=torch.long, device=device)
        tokens = torch.zeros(self.k + 1, 1, dtype=torch.long, device=device)
        for kv in kv_lens:
            # The k + 1 positions of a step that ends at the bucket's last one.
            positions = [max(0, kv - 1 - self.k + i) for i in range(self.k + 1)]
            verify(tokens, torch.tensor(positions, device=device), kv, rows)
            if isinstance(self.drafter, Int8Drafter):
                draft = self.drafter.engine
                one = torch.zeros(1, 1, dtype=torch.long, device=device)
                draft.step(one, torch.tensor([kv - 1], device=device), kv)
        if isinstance(self.drafter, Int8Drafter):
            self.drafter.tokens, self.drafter.written = [], 0  # its cache holds no context

    def _graphs(self) -> int:
        count = len(self.engine.compile_seconds)
        if isinstance(self.drafter, Int8Drafter):
            count += len(self.drafter.engine.compile_seconds)
        return count
