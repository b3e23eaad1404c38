"""The int8 drafter's output layer: the part of the vocabulary that drafts come from.

Gemma's vocabulary has 262,144 words, and its output layer is 63% of Gemma 3 270M's weights:
about 10 of the 15.7 ms of an int8 draft step under AVX2 (an AMD EPYC Zen 3, 2026-12-07). A
draft need not range over all of it. Verification decides every token (speculative.py), so a
word the drafter cannot propose costs only the drafts that would have been right; sampled
drafts stay exact too, since their distribution is zero outside these rows and the accept/reject
rule reads it as it is. The drafter's head holds the rows of

- the first ``words`` ids (``WORDS``): SentencePiece and BPE vocabularies number their pieces
  in merge order, the most frequent first;
- every piece of one Latin character: Gemma's single characters (punctuation, letters) come
  after all the merges, at the end of its vocabulary;
- every token of the request's context, prompt and output so far, added as they appear: the
  names and rare words that a text repeats.

Of the 896 greedy tokens that the default model wrote after seven prompts (five Shakespeare
excerpts, a question, the start of a Python function; /tmp script, 2026-12-07), 99.2% were
among these rows with 8,192 words, 99.6% with 32,768; without the single characters 97.8%,
without the context 77.8%.

The rows are int8 copies of the drafter's own embedding rows (quant.Int8Linear, in its kernel
layout). The context's tokens are written into spare rows in place, so a compiled draft graph
reads them as they come; spare rows are masked with -inf after the graph (``mask``). When the
spare rows run out, they are refilled with the latest context's tokens.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .quant import Int8Linear
from .tokenizer import Tokenizer

WORDS = 8192  # ids from 0 that the head always holds
CONTEXT_ROWS = 4096  # at most this many more rows for the context's own tokens
ROW_MULTIPLE = 64  # whole blocks of 16 lanes in four row groups (quant_kernels.matvec_int8)


def base_ids(tokenizer: Tokenizer, vocab_size: int, words: int) -> list[int]:
    """The ids the head always holds: the first ``words``, then the Latin characters."""
    first = min(words, vocab_size)
    letters = [
        t for t in range(first, min(tokenizer.vocab_size, vocab_size)) if latin(tokenizer.piece(t))
    ]
    return list(range(first)) + letters


def latin(piece: str) -> bool:
    """One character of Basic Latin through Latin Extended-B (U+0000-U+024F)."""
    return len(piece) == 1 and ord(piece) < 0x250


class DraftVocabulary:
    """The rows of ``embedding`` (the drafter's int8 output layer) that drafts come from:
    ``head`` (an Int8Linear of its own), and what its outputs stand for (``token``,
    ``spread``)."""

    def __init__(
        self, embedding: Int8Linear, tokenizer: Tokenizer, words: int, max_context: int
    ) -> None:
        base = base_ids(tokenizer, embedding.out_features, words)
        rows = len(base) + min(max_context, CONTEXT_ROWS)
        rows = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
        device = embedding.weight.device
        self.source = embedding
        self.vocab_size = embedding.out_features
        self.head = Int8Linear(embedding.in_features, rows, embedding.dtype).to(device)
        self.head.weight.zero_()
        self.head.scale.zero_()
        self.mask = torch.full((rows,), float("-inf"), device=device)  # 0 for a held row
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)  # each row's token
        self.held: dict[int, int] = {}  # token -> its row: the base first, then the context's
        self.fixed = len(base)
        self._write(base)

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    def add(self, context: list[int]) -> None:
        """Hold every token of ``context`` (rows are written only for new ones); when the
        spare rows run out, they hold the latest context's tokens instead."""
        new = [t for t in dict.fromkeys(context) if t not in self.held]
        if not new:
            return
        if len(self.held) + len(new) > self.rows:
            self.held = dict(itertools.islice(self.held.items(), self.fixed))
            self.mask[self.fixed :] = float("-inf")
            latest = (t for t in dict.fromkeys(reversed(context)) if t not in self.held)
            new = list(itertools.islice(latest, self.rows - self.fixed))
        self._write(new)

    def token(self, row: int) -> int:
        """The token that row ``row`` of the head's output stands for."""
        return int(self.ids[row])

    def spread(self, q: Tensor) -> Tensor:
        """A distribution over the head's rows (rows,) -> over the vocabulary (vocab,)."""
        return torch.zeros(self.vocab_size, dtype=q.dtype, device=q.device).index_add_(
            0, self.ids, q
        )

    def _write(self, tokens: list[int]) -> None:
        start = len(self.held)
        rows = torch.arange(start, start + len(tokens), device=self.ids.device)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.ids.device)
        q, scale = self.source.rows(ids)
        self.head.set_rows(rows, q, scale)
        self.ids[rows] = ids
        self.mask[rows] = 0.0
        self.held.update(zip(tokens, range(start, start + len(tokens)), strict=True))
