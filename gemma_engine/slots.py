"""Slots: the rows of the KV cache, which sequence each holds, and which prefix it can reuse.

The engine's cache has ``max_batch`` rows; a running request owns one. When it finishes, the
row keeps the tokens it holds (idle), so that a later request that starts with the same tokens
(a chat sending its history again) prefills only the rest, as llama.cpp's ``cache_prompt``.

Global layers keep every position, so any common prefix is still there. A sliding layer keeps a
ring of ``ring`` entries (the window + model.RING_SLACK, see model.KVCache): a row that has
written positions up to ``written`` (exclusive) still holds ``[written - ring, written)``, the
latest write of each entry. Continuing at position p needs the window before it, positions
``[p - window + 1, p)``, so a prefix of p tokens is reusable iff
``written - ring <= max(0, p - window + 1)``. If it is not, nothing can be reused: recomputing
the missing window would need the window before it in the layer below, back to position 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph of their own: powers of two below ``max_batch``, then it."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return [*sizes, max_batch]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class Slot:
    index: int  # the cache row
    tokens: list[int] = field(default_factory=list)  # the positions 0.. it holds, in order
    written: int = 0  # highest position written + 1 since it last restarted from position 0
    last_used: int = -1  # when it was last acquired (a counter); -1: never
    busy: bool = False  # owned by a request (prefilling or decoding)


class SlotTable:
    """Bookkeeping for the cache rows; the scheduler calls it between steps (not thread-safe)."""

    def __init__(self, max_batch: int, max_seq_len: int, window: int | None, ring: int) -> None:
        self.slots = [Slot(i) for i in range(max_batch)]
        self.max_seq_len = max_seq_len
        self.window = window  # None: no sliding layers, every prefix stays reusable
        self.ring = ring
        self._clock = 0

    def free(self) -> int:
        return sum(not s.busy for s in self.slots)

    def reusable(self, slot: Slot, ids: list[int]) -> int:
        """Prompt tokens of ``ids`` that ``slot`` holds and can serve (see the module doc).

        At least the last prompt token is always recomputed: its logits give the first token.
        """
        p = common_prefix(slot.tokens, ids[:-1])
        if p and self.window is not None and slot.written - self.ring > max(0, p - self.window + 1):
            return 0  # the ring has overwritten part of the window before p
        return p

    def acquire(self, ids: list[int], reuse: bool = True) -> tuple[Slot, int]:
        """A free slot for a prompt and how many of its tokens are already cached there: the
        slot with the longest reusable prefix, else the least recently used one."""
        free = [s for s in self.slots if not s.busy]
        assert free, "the scheduler admits only while a slot is free"
        cached = {s.index: self.reusable(s, ids) if reuse else 0 for s in free}
        slot = max(free, key=lambda s: (cached[s.index], -s.last_used))
        if not cached[slot.index]:
            slot = min(free, key=lambda s: s.last_used)
        p = cached[slot.index]
        slot.busy, slot.last_used = True, self._clock
        self._clock += 1
        slot.tokens = slot.tokens[:p]
        if not p:
            slot.written = 0
        return slot, p

    def release(self, slot: Slot) -> None:
        slot.busy = False  # idle: keeps its tokens for reuse

    def reset(self, slot: Slot) -> None:
        """Forget what a slot holds (after a failed step, its contents are unknown)."""
        slot.tokens, slot.busy = [], False

    def wrote(self, slot: Slot, tokens: list[int], start: int) -> None:
        """Record that ``tokens`` were written at positions ``start``..."""
        assert start <= len(slot.tokens), "a slot's positions are written in order"
        slot.tokens[start:] = tokens
        slot.written = max(slot.written, start + len(tokens))

    def pads(self, count: int, kv_len: int, prefilling: Slot | None) -> list[tuple[Slot, int]]:
        """``count`` slots and positions for the padded rows of a batch.

        A padded row runs the step like any other, so it writes one position of its cache row:
        a slot no request is using, at the end of what it holds, where no live sequence reads.
        Its position stays below ``kv_len`` (the live rows' bucket), which keeps its own key
        visible to it (no all-masked row, no NaN) and the bucket unchanged; a slot holding
        more gives up its tail. Slots that lose the least come first. When every slot is
        taken, the one being prefilled pads, at its next chunk's first position, which that
        chunk overwrites (the caller's bucket must then cover it).
        """
        spare = sorted(
            (s for s in self.slots if not s.busy),
            key=lambda s: (len(s.tokens) >= kv_len, s.last_used),
        )
        out = []
        for slot in spare[:count]:
            pos = min(len(slot.tokens), kv_len - 1)
            del slot.tokens[pos:]
            out.append((slot, pos))
        if len(out) < count:
            assert prefilling is not None and len(out) + 1 == count, "too few slots to pad"
            out.append((prefilling, len(prefilling.tokens)))
        for slot, pos in out:
            slot.written = max(slot.written, pos + 1)
        return out
