"""Shared fixtures: tiny random Gemma checkpoints saved by transformers, the reference."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

# Gemma's SentencePiece layout: pad 0, eos 1, bos 2, unk 3, then the chat control pieces.
SPECIALS = ["<start_of_turn>", "<end_of_turn>"]
TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. Café naïve déjà vu, 東京 and 北京, emoji 🙂🚀.\n"
    "def main():\n    return [x ** 2 for x in range(10)]  # squares\n"
    "Numbers 12345 and 3.14159; tabs\tand  double  spaces.\n"
)


def train_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """Train a small SentencePiece BPE model shaped like Gemma's (byte fallback, no prefix)."""
    lines = [TRAIN_TEXT * 3, *(f"line {i}: {TRAIN_TEXT[i % 50 :]}" for i in range(200))]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        control_symbols=SPECIALS,
        character_coverage=1.0,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.model")


def tiny_configs() -> dict[str, object]:
    """Configs that exercise every architectural switch between them."""
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, max_position_embeddings=256)
    return {
        # MHA; head_dim (32) != hidden / heads (16)
        "gemma": GemmaConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32, **common
        ),
        # GQA; a window of 8 shorter than the sequence; both soft-caps; an unusual score scale
        "gemma2": Gemma2Config(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
            **common,
        ),
        # MQA; QK-norm; local and global rope thetas, linear rope scaling on global layers
        "gemma3": Gemma3TextConfig(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=32,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            **common,
        ),
    }


def save_tiny(kind: str, folder: Path, tokenizer_file: Path, seed: int = 0):
    """Save a random tiny model of ``kind`` with transformers; return the reference model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_configs()[kind]
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than init: peaked logits, and norms away from zero
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.model").write_bytes(tokenizer_file.read_bytes())
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer_file) -> dict[str, tuple[Path, object]]:
    out = {}
    for kind in tiny_configs():
        folder = tmp_path_factory.mktemp(kind)
        out[kind] = (folder, save_tiny(kind, folder, tokenizer_file))
    return out
