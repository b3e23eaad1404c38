"""Shared fixtures: tiny random Gemma checkpoints saved by transformers, the reference."""

from __future__ import annotations

import io
import json
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


def save_tiny(kind: str, folder: Path, tokenizer_file: Path, seed: int = 0, config=None):
    """Save a random tiny model of ``kind`` (or of a changed copy of its ``config``) with
    transformers; return the reference model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config or tiny_configs()[kind]
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


# -- Gemma 3n and 4 --------------------------------------------------------------------------
# Gemma 4's tokenizer.json layout: the same first five ids, its own turn markers.
JSON_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]


def train_json_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A small tokenizer.json shaped like Gemma 4's (what transformers' GemmaTokenizer builds:
    BPE with byte fallback, spaces as U+2581, no prefix space), with a tokenizer_config.json.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    def gemma_pipeline(tok: Tokenizer) -> None:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )

    lines = [TRAIN_TEXT * 3, *(f"line {i}: {TRAIN_TEXT[i % 50 :]}" for i in range(200))]
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    gemma_pipeline(learner)
    learned_size = vocab_size - len(JSON_SPECIALS) - 256
    learner.train_from_iterator(lines, BpeTrainer(vocab_size=learned_size, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    # Gemma's id layout: specials, the 256 byte-fallback pieces, then the learned pieces.
    vocab = {piece: i for i, piece in enumerate(JSON_SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(JSON_SPECIALS) + b for b in range(256)})
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    bpe = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    gemma_pipeline(tok)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in JSON_SPECIALS])
    assert tok.get_vocab_size() <= vocab_size
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    names = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    config = {"tokenizer_class": "GemmaTokenizer", "mask_token": "<mask>", **names}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder / "tokenizer.json"


@pytest.fixture(scope="session")
def json_tokenizer_file(tmp_path_factory) -> Path:
    return train_json_tokenizer(tmp_path_factory.mktemp("tokjson"))


LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def tiny_new_configs() -> dict[str, object]:
    """Gemma 4 and 3n configs that switch on every feature the engine implements for them."""
    from transformers import Gemma3nTextConfig, Gemma4TextConfig

    common = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,  # shorter than the sequences
        layer_types=LAYER_TYPES,
        max_position_embeddings=256,
        final_logit_softcapping=30.0,
    )
    gemma4 = dict(
        common,
        intermediate_size=128,
        global_head_dim=32,  # full layers: their own head size and key/value heads
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
    )
    return {
        # k_eq_v, PLE, KV sharing (layers 4, 5 read 3 and 2), double-wide MLP, proportional rope
        "gemma4": Gemma4TextConfig(
            **gemma4,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,  # int4 groups (of 8) need 16 inputs
            vocab_size_per_layer_input=512,
            use_double_wide_mlp=True,
        ),
        # the 26B-A4B layout: experts beside the dense MLP on every layer, no PLE, no sharing
        "gemma4_moe": Gemma4TextConfig(
            **gemma4,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
        # AltUp, LAuReL, activation sparsity, per-layer widths, KV sharing, and a per-layer
        # table shorter than the vocabulary (ids 480-511 read row 0)
        "gemma3n": Gemma3nTextConfig(
            **common,
            intermediate_size=[128, 128, 96, 96, 128, 128],
            vocab_size_per_layer_input=480,
            num_kv_shared_layers=3,
            hidden_size_per_layer_input=8,
            altup_num_inputs=4,
            laurel_rank=8,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
        ),
    }


def save_tiny_new(kind: str, folder: Path, tokenizer_file: Path, seed: int = 0):
    """Save a random tiny Gemma 4/3n model with transformers; return the reference, reloaded.

    Their norms compute x * w (not x * (1 + w)), so norm weights and the other scales are
    drawn around 1, their neutral value, and layer_scalar (a buffer, which a loop over
    parameters misses) is set explicitly, so that every one of these paths is exercised.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_new_configs()[kind]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.1)
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer, "layer_scalar"):
                # Around 1: scalars well below it shrink the residual stream and make the
                # network chaotic enough that fused and eager attention differ by 1e-4.
                layer.layer_scalar.fill_(1.1 if i % 2 == 0 else 0.9)
    model.save_pretrained(folder, safe_serialization=True)
    for file in (tokenizer_file, tokenizer_file.with_name("tokenizer_config.json")):
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    kwargs = {"attn_implementation": "eager"}
    if kind.startswith("gemma4"):
        kwargs["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


@pytest.fixture(scope="session")
def tiny_new_checkpoints(
    tmp_path_factory, tokenizer_file, json_tokenizer_file
) -> dict[str, tuple[Path, object]]:
    """Gemma 4 checkpoints ship a tokenizer.json, Gemma 3n a tokenizer.model, as on the hub."""
    out = {}
    for kind in tiny_new_configs():
        folder = tmp_path_factory.mktemp(kind)
        tokenizer = json_tokenizer_file if kind.startswith("gemma4") else tokenizer_file
        out[kind] = (folder, save_tiny_new(kind, folder, tokenizer))
    return out


# -- hostile inputs ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def hostile_server():
    """A fork server that runs each hostile case in a fresh, memory-limited process."""
    from hostile import Server

    server = Server()
    yield server
    server.close()
