"""The tokenizer, with BOS handling and a streaming decoder.

Gemma 1-3 and 3n checkpoints ship a SentencePiece ``tokenizer.model``; Gemma 4 ships only a
Hugging Face ``tokenizer.json``, read with the ``tokenizers`` library. Both sit behind the same
``Tokenizer`` interface.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from .errors import CheckpointError
from .file_checks import MAX_TOKENIZER_BYTES, check_size, read_json
from .inputs import check_text


class _SentencePiece:
    def __init__(self, model: str | Path | bytes) -> None:
        # sentencepiece >= 0.2.2 refuses over-long pieces itself (pyproject.toml says why).
        what = "the SentencePiece tokenizer" if isinstance(model, bytes) else str(model)
        try:
            if isinstance(model, bytes):
                if not model:
                    raise RuntimeError("the model is empty")
                self.sp = spm.SentencePieceProcessor(model_proto=model)
            else:
                check_size(Path(model), MAX_TOKENIZER_BYTES)
                self.sp = spm.SentencePieceProcessor(model_file=str(model))
        except (OSError, RuntimeError) as err:
            raise CheckpointError(
                f"cannot load {what}: {err}; it is corrupted or not a SentencePiece model"
            ) from None
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        self.vocab_size = self.sp.get_piece_size()
        if self.vocab_size < 1 or self.bos_id < 0 or self.eos_id < 0:
            raise CheckpointError(f"{what} defines no BOS or EOS piece; Gemma's has both")

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)  # control pieces are never matched in raw text

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)  # control pieces decode to nothing

    def piece_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None

    def piece(self, token: int) -> str:
        return self.sp.id_to_piece(token)

    def files(self) -> dict[str, bytes]:
        return {"tokenizer.model": self.sp.serialized_model_proto()}


class _TokenizerJson:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = path
        check_size(path, MAX_TOKENIZER_BYTES)  # Gemma 4's is 32 MB
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # OSError, or the plain Exception tokenizers raises
            raise CheckpointError(f"cannot load the tokenizer {path}: {err}") from None
        # Special tokens in raw text are encoded as text, never as the special token, as
        # SentencePiece does with control pieces: templates insert them by id.
        self.tok.encode_special_tokens = True
        names = _special_names(path.with_name("tokenizer_config.json"))
        self.bos_id = self._need(names["bos_token"], path)
        self.eos_id = self._need(names["eos_token"], path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def _need(self, piece: str, path: Path) -> int:
        i = self.tok.token_to_id(piece)
        if i is None:
            raise CheckpointError(f"{path} has no {piece!r} token")
        return i

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def piece_id(self, piece: str) -> int | None:
        return self.tok.token_to_id(piece)

    def piece(self, token: int) -> str:
        return self.tok.id_to_token(token) or ""

    def files(self) -> dict[str, bytes]:
        out = {"tokenizer.json": self.path.read_bytes()}
        if (config := self.path.with_name("tokenizer_config.json")).is_file():
            out[config.name] = config.read_bytes()  # names the BOS and EOS tokens
        return out


def _special_names(config_file: Path) -> dict[str, str]:
    """BOS/EOS token names from tokenizer_config.json where it names them; Gemma's otherwise."""
    names = {"bos_token": "<bos>", "eos_token": "<eos>"}
    if config_file.is_file():
        config = read_json(config_file)
        for key in names:
            value = config.get(key)
            if isinstance(value, dict):  # the older AddedToken form
                value = value.get("content")
            if isinstance(value, str):
                names[key] = value
    return names


class Tokenizer:
    """``model``: a SentencePiece file or serialized proto, or a ``tokenizer.json`` path."""

    def __init__(self, model: str | Path | bytes) -> None:
        if not isinstance(model, bytes) and Path(model).suffix == ".json":
            self._impl: _SentencePiece | _TokenizerJson = _TokenizerJson(Path(model))
        else:
            self._impl = _SentencePiece(model)
        self.bos_id = self._impl.bos_id
        self.eos_id = self._impl.eos_id
        self.vocab_size = self._impl.vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        check_text(text)
        # Control pieces such as <start_of_turn> are never matched in raw text: templates insert
        # them by id (see special_id), so user text cannot forge a turn.
        ids = self._impl.encode(text)
        return [self.bos_id, *ids] if add_bos else ids

    def check_fits(self, model_vocab_size: int) -> None:
        """Every id this tokenizer produces must be a row of the model's embedding."""
        if self.vocab_size > model_vocab_size:
            raise CheckpointError(
                f"the tokenizer has {self.vocab_size:,} pieces but the model's vocabulary only "
                f"{model_vocab_size:,}; the tokenizer belongs to another model"
            )

    def decode(self, ids: list[int]) -> str:
        # Models may pad their vocabulary past the tokenizer's (Gemma 3 4b+: 262,208 vs
        # 262,144); such ids have no text.
        return self._impl.decode([i for i in ids if 0 <= i < self.vocab_size])

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for alone (logprobs report tokens one by one): a
        byte-fallback piece ``<0xAB>`` is that byte, U+2581 a space, a control piece its name."""
        if not 0 <= token < self.vocab_size:
            return b""
        piece = self._impl.piece(token)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def piece(self, token: int) -> str:
        """The vocabulary's own text of ``token`` (U+2581 for a space, ``<0xAB>`` for a byte)."""
        return self._impl.piece(token) if 0 <= token < self.vocab_size else ""

    def has_piece(self, piece: str) -> bool:
        return self._impl.piece_id(piece) is not None

    def special_id(self, piece: str) -> int:
        """The id of a control piece such as '<end_of_turn>'; an error if the vocab lacks it."""
        i = self._impl.piece_id(piece)
        if i is None:
            raise CheckpointError(f"this tokenizer has no {piece!r} token, which --chat needs")
        return i

    def save(self, folder: Path) -> None:
        """Write the tokenizer's files into ``folder`` as they were read."""
        for name, data in self._impl.files().items():
            (folder / name).write_bytes(data)


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
