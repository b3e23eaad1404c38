"""SentencePiece tokenizer with BOS handling and a streaming decoder."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from .errors import CheckpointError


class Tokenizer:
    def __init__(self, model: Path | bytes) -> None:
        try:
            if isinstance(model, bytes):
                self.sp = spm.SentencePieceProcessor(model_proto=model)
            else:
                self.sp = spm.SentencePieceProcessor(model_file=str(model))
        except (OSError, RuntimeError) as err:
            raise CheckpointError(f"cannot load the SentencePiece tokenizer: {err}") from None
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # Control pieces such as <start_of_turn> are never matched in raw text: templates insert
        # them by id (see special_id), so user text cannot forge a turn.
        ids = self.sp.encode(text)
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        # Models may pad their vocabulary past the tokenizer's (Gemma 3 4b+: 262,208 vs
        # 262,144); such ids have no text.
        return self.sp.decode([i for i in ids if 0 <= i < self.vocab_size])

    def has_piece(self, piece: str) -> bool:
        return self.sp.id_to_piece(self.sp.piece_to_id(piece)) == piece

    def special_id(self, piece: str) -> int:
        """The id of a control piece such as '<end_of_turn>'; an error if the vocab lacks it."""
        if not self.has_piece(piece):
            raise CheckpointError(f"this tokenizer has no {piece!r} token, which --chat needs")
        return self.sp.piece_to_id(piece)


class IncrementalDecoder:
    """Turns a growing list of ids into text pieces, safely.

    Each step decodes a short window that starts a few tokens back, and emits only what the
    window adds past the text already emitted. Decoding with left context keeps a leading space
    that a lone piece would lose, and holding back text ending in U+FFFD never emits half of a
    multi-byte character spread over byte-fallback tokens.
    """

    def __init__(self, tokenizer: Tokenizer, context: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context or [])[-4:]
        self.prefix = 0  # the decode window starts here
        self.read = len(self.ids)  # ids[:read] are already emitted (or context)

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]
