"""tokenizer.json (Gemma 4's only tokenizer file) against transformers' GemmaTokenizer.

The tokenizer is built at test time with the ``tokenizers`` library in Gemma's layout (BPE with
byte fallback, spaces as U+2581, turn markers as special tokens); transformers loads the same
file through its own Gemma tokenizer class.
"""

from __future__ import annotations

import pytest

from gemma_engine import CheckpointError, Tokenizer
from gemma_engine.tokenizer import IncrementalDecoder

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, trailing   ",
    "runs of     five spaces\tand\t\ttabs",
    "def f(x):\n\treturn x ** 2  # comment\n",
    "digits 1234567890 and 3.14159",
    "accents: café naïve déjà vu Ærøskøbing",
    "CJK 東京 北京 日本語のテキスト",
    "emoji 🙂🚀👩‍💻 mixed with text 🦀𝄞",
    "\n\n\nnewlines\r\nand carriage returns",
    "special tokens in text: <|turn>user\nhi<turn|> <bos><eos> <mask>",
    "",
]


@pytest.fixture(scope="module")
def pair(json_tokenizer_file):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(json_tokenizer_file.parent)
    assert type(reference).__name__ == "GemmaTokenizer"
    return Tokenizer(json_tokenizer_file), reference


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(pair, text):
    ours, reference = pair
    ids = ours.encode(text, add_bos=False)
    # Special tokens in the text are text to us (split_special_tokens in transformers' terms).
    assert ids == reference.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert ours.encode(text) == [ours.bos_id, *ids]
    assert ours.decode(ids) == reference.decode(ids) == text


def test_special_tokens_are_not_parsed_from_text(pair):
    ours, reference = pair
    turn = ours.special_id("<|turn>")
    assert turn in reference.encode("<|turn>user", add_special_tokens=False)
    assert turn not in ours.encode("<|turn>user")
    # Inserted by id, they decode to nothing, as SentencePiece's control pieces do.
    assert ours.decode([turn, *ours.encode("hi", add_bos=False)]) == "hi"
    assert (ours.bos_id, ours.eos_id) == (2, 1)
    assert ours.has_piece("<turn|>") and not ours.has_piece("<start_of_turn>")


@pytest.mark.parametrize("text", TEXTS[1:9])
def test_streaming_decode_equals_full_decode(pair, text):
    ours, _ = pair
    ids = ours.encode(text, add_bos=False)
    decoder = IncrementalDecoder(ours, ours.encode("prefix words "))
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == ours.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_multibyte_characters_split_over_byte_tokens(pair):
    ours, _ = pair
    text = "🦀𝄞"  # not in the training text: byte fallback, 4 tokens each
    ids = ours.encode(text, add_bos=False)
    assert len(ids) == 8
    decoder = IncrementalDecoder(ours)
    pieces = [decoder.push(t) for t in ids]
    assert pieces[:3] == ["", "", ""] and pieces[3] == "🦀"  # held back until complete
    assert "".join(pieces) + decoder.flush() == text


def test_save_writes_the_same_file(pair, tmp_path):
    ours, _ = pair
    ours.save(tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    again = Tokenizer(tmp_path / "tokenizer.json")
    assert again.encode(TEXTS[7]) == ours.encode(TEXTS[7])


def test_bad_tokenizer_json_is_a_checkpoint_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE"')
    with pytest.raises(CheckpointError, match="tokenizer"):
        Tokenizer(bad)
