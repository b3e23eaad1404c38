"""The SentencePiece tokenizer against transformers' Gemma tokenizer, and streaming decode."""

from __future__ import annotations

import pytest

from gemma_engine import Tokenizer
from gemma_engine.tokenizer import IncrementalDecoder

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, trailing   ",
    "def f(x):\n\treturn x ** 2  # comment\n",
    "digits 1234567890 and 3.14159",
    "accents: café naïve déjà vu Ærøskøbing",
    "CJK 東京 北京 日本語のテキスト",
    "emoji 🙂🚀👩‍💻 mixed with text",
    "\n\n\nnewlines\r\nand carriage returns",
    "",
]


@pytest.fixture(scope="module")
def pair(tokenizer_file):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tokenizer_file.parent)
    return Tokenizer(tokenizer_file), reference


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    ours, reference = pair
    ids = ours.encode(text, add_bos=False)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.encode(text) == [ours.bos_id, *ids]
    assert ours.decode(ids) == reference.decode(ids) == text


def test_control_tokens_are_not_parsed_from_text(pair):
    ours, reference = pair
    start = ours.special_id("<start_of_turn>")
    # transformers turns the literal text into the control token; we never do, so a user's
    # text cannot open or close a chat turn. Templates insert these ids directly.
    assert start in reference.encode("<start_of_turn>user", add_special_tokens=False)
    assert start not in ours.encode("<start_of_turn>user")
    assert ours.decode(ours.encode("<start_of_turn>user", add_bos=False)) == "<start_of_turn>user"


@pytest.mark.parametrize("text", TEXTS[2:8])
def test_streaming_decode_equals_full_decode(pair, text):
    ours, _ = pair
    context = ours.encode("prefix words ")
    ids = ours.encode(text, add_bos=False)
    decoder = IncrementalDecoder(ours, context)
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == ours.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_multibyte_characters_split_over_byte_tokens(pair):
    ours, _ = pair
    text = "🦀𝄞"  # not in the training text: byte fallback, 4 tokens each
    ids = ours.encode(text, add_bos=False)
    assert len(ids) >= 8
    decoder = IncrementalDecoder(ours)
    pieces = [decoder.push(t) for t in ids]
    assert pieces[:3] == ["", "", ""]  # held back until the character is complete
    assert "".join(pieces) + decoder.flush() == text


def test_leading_space_survives_streaming(pair):
    ours, _ = pair
    ids = ours.encode(" the dog", add_bos=False)
    decoder = IncrementalDecoder(ours, ours.encode("See"))
    assert "".join(decoder.push(t) for t in ids) + decoder.flush() == " the dog"
