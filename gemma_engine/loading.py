"""Find a checkpoint (folder, GGUF file, hub id or the default) and load it strictly.

Weights come only from safetensors (memory-mapped) or GGUF: a pickle-based ``.bin``/``.pt``
file can run arbitrary code when loaded, so it is refused, never opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import GemmaConfig
from .errors import CheckpointError, CheckpointNotFoundError
from .file_checks import (
    check_weight_dtype,
    read_generation_config,
    read_json,
    read_safetensors,
    shard_files,
)
from .model import GemmaForCausalLM
from .quant import QUANT_BUFFERS, check_saved, quantize_model

_HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.model",
    "tokenizer.json",  # Gemma 4 ships no tokenizer.model
    "tokenizer_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Multimodal Gemma 3/3n/4 checkpoints nest the text model; these prefixes map back onto ours.
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
# Their image and audio towers, and the embedders that feed those into the text model, are
# skipped: the engine runs text only.
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",  # Gemma 3, 3n, 4
    "model.multi_modal_projector.",  # Gemma 3
    "model.audio_tower.",  # Gemma 3n, 4 (E2B, E4B)
    "model.embed_vision.",  # Gemma 3n, 4
    "model.embed_audio.",  # Gemma 3n, 4
)
# A KV-shared layer (Gemma 3n/4) computes no keys or values, but checkpoints still hold these;
# transformers ignores them too.
_UNUSED_BY_KV_SHARED_LAYERS = ("k_proj", "v_proj", "k_norm", "v_norm")


@dataclass
class Checkpoint:
    """What a model source resolves to: a config, weights to load, a tokenizer."""

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer_model: Path | bytes
    generation_config: dict


def resolve(model: str | os.PathLike | None) -> Path:
    """A local folder or .gguf file for ``model``: a path, a hub id, or None for the default."""
    if model is None:
        from .gguf import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file() and path.suffix in _PICKLE_SUFFIXES:
            raise CheckpointError(_pickle_refusal(path))
        if path.is_file() and path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file; pass a checkpoint folder or a .gguf file")
        return path
    text = str(model)
    looks_local = text.startswith((".", "/", "~")) or text.endswith(".gguf") or text.count("/") != 1
    if looks_local:
        raise CheckpointNotFoundError(
            f"model {text!r} not found: no such folder or file, and it is not a hub id "
            "(owner/name); check the path"
        )
    return _download(text)


def _download(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError:
        offline = constants.HF_HUB_OFFLINE
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise CheckpointNotFoundError(
            f"hub model {repo_id!r} is not in the local Hugging Face cache and {why}; "
            f"download it where the hub is reachable (hf download {repo_id}) or pass a "
            "local folder"
        ) from None
    except HfHubHTTPError as err:
        raise CheckpointNotFoundError(
            f"hub model {repo_id!r} could not be downloaded ({type(err).__name__}: "
            f"{str(err).splitlines()[0]}); check the id and your access (hf auth login)"
        ) from None


def _pickle_refusal(path: Path) -> str:
    return (
        f"{path} is a pickle checkpoint; gemma-engine loads only safetensors or GGUF, because "
        "unpickling a file can run arbitrary code. Convert it to safetensors where you trust it "
        "(transformers: model.save_pretrained(folder, safe_serialization=True))"
    )


def read_checkpoint(path: Path, dtype: torch.dtype) -> Checkpoint:
    """Read a folder (config.json + safetensors + tokenizer.model) or a .gguf file."""
    if path.is_file():
        from .gguf import read_gguf

        gguf = read_gguf(path, dtype=dtype)
        return Checkpoint(
            gguf.config, gguf.state_dict, gguf.tokenizer_model, gguf.generation_config
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointNotFoundError(
            f"{path} has no config.json; is it a Hugging Face checkpoint?"
        )
    config = read_json(config_file)
    check_saved(config)
    tokenizer = path / "tokenizer.model"  # SentencePiece; Gemma 4 ships tokenizer.json only
    if not tokenizer.is_file():
        tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointNotFoundError(
            f"{path} has no tokenizer.model (SentencePiece) or tokenizer.json (Hugging Face)"
        )
    gen = read_generation_config(path / "generation_config.json")
    return Checkpoint(config, _read_safetensors(path, dtype), tokenizer, gen)


def _read_safetensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = shard_files(index, folder)
    elif (folder / "model.safetensors").is_file():
        shards = [folder / "model.safetensors"]
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(_pickle_refusal(folder / pickles[0]))
        raise CheckpointNotFoundError(
            f"{folder} has no model.safetensors or model.safetensors.index.json"
        )
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(read_safetensors(shard))
    for name, tensor in tensors.items():
        if tensor.dtype.is_floating_point and not _is_quant_buffer(name, tensors):
            tensors[name] = tensor.to(dtype)
    return tensors


def _is_quant_buffer(name: str, tensors: dict[str, torch.Tensor]) -> bool:
    """A quantized weight's scale or offset, which keeps its own dtype (Gemma 4's router.scale,
    a float weight of its own, does not qualify: it has no integer .weight beside it)."""
    for suffix in QUANT_BUFFERS:
        if name.endswith(suffix):
            weight = tensors.get(name[: -len(suffix)] + ".weight")
            return weight is not None and not weight.dtype.is_floating_point
    return False


def text_state_dict(
    tensors: dict[str, torch.Tensor], config: GemmaConfig
) -> dict[str, torch.Tensor]:
    """Map the text model's tensors onto our (Hugging Face) names; drop what the text model
    does not use: vision and audio tensors, and the keys and values of KV-shared layers."""
    unused = tuple(
        f"model.layers.{i}.self_attn.{part}."
        for i, spec in enumerate(config.layers)
        if spec.kv_source != i
        for part in _UNUSED_BY_KV_SHARED_LAYERS
    )
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        for prefix, ours in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        if unused and name.startswith(unused):
            continue
        out[name] = tensor
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # a tied head is the embedding; some exports repeat it
    return out


def build_model(
    config: GemmaConfig,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    quantized: tuple[str, int | None] | None = None,
) -> GemmaForCausalLM:
    """Build on the meta device and assign the checkpoint's tensors: no second copy.

    ``quantized`` (method, group size) describes a checkpoint saved already quantized.
    """
    with torch.device("meta"):
        model = GemmaForCausalLM(config)
        if quantized is not None:
            quantize_model(model, *quantized, dtype)
    state = text_state_dict(tensors, config)
    metas = model.state_dict()
    expected = {name: p.shape for name, p in metas.items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s): "
            f"{', '.join(missing[:5])}; is it complete and a Gemma text model?"
        )
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): "
            f"{', '.join(unexpected[:5])}; does config.json match the weights?"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(state[name].shape)}, "
                f"but config.json implies {tuple(shape)}"
            )
        want = metas[name].dtype
        check_weight_dtype(name, state[name], want)
        if not want.is_floating_point and state[name].dtype != want:  # quantized weights
            raise CheckpointError(
                f"tensor {name} is {state[name].dtype} but a quantized checkpoint stores "
                f"{want}; save it again with this version of gemma-engine"
            )
    state = {name: t.to(device) for name, t in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
