"""Bounded, checked reads of a checkpoint folder's files: JSON, the shard index, safetensors.

Every file comes with the weights, from whoever made them. Each read here is bounded in size
before it is read, and every way it can fail (too large, not UTF-8, not JSON, nested past
Python's recursion limit, the wrong JSON types, a shard path that leaves the folder, a
safetensors header the library refuses) ends in a ``CheckpointError`` that names the file.
GGUF files have their own walk, in ``gguf_check.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from .errors import CheckpointError, CheckpointNotFoundError

# Real files are far smaller: a Gemma config.json is a few KB, the index of a 27B model ~100 KB,
# Gemma 4's tokenizer.json 32 MB and tokenizer.model files ~5 MB.
MAX_CONFIG_BYTES = 16 << 20
MAX_INDEX_BYTES = 64 << 20
MAX_TOKENIZER_BYTES = 256 << 20
MAX_SHARDS = 10_000
# Tensor dtypes a checkpoint may hold: floats (weights), and the integer types of weights this
# engine saved quantized (int8 weights, int4 packed in uint8/int32 words).
_WEIGHT_INTS = (torch.int8, torch.uint8, torch.int32)


def check_size(path: Path, max_bytes: int) -> int:
    """The size of the regular file ``path``, refused above ``max_bytes`` before it is read."""
    try:
        if not path.is_file():
            raise CheckpointError(f"{path} is not a regular file")
        size = path.stat().st_size
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    if size > max_bytes:
        raise CheckpointError(
            f"{path} is {size:,} bytes, over the {max_bytes:,} such a file can sensibly be; "
            "it is not what its name says"
        )
    return size


def read_json(path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """The JSON object in ``path``: size-bounded, strict UTF-8, and an object at the top."""
    check_size(path, max_bytes)
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)  # the file may have grown since the stat
        if len(data) > max_bytes:
            raise CheckpointError(f"{path} is over {max_bytes:,} bytes")
        value = json.loads(data.decode("utf-8"))
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); it is corrupted"
        ) from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise CheckpointError(f"{path} nests JSON too deeply to be a config file") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def read_generation_config(path: Path) -> dict[str, Any]:
    """generation_config.json, or {} when absent; its token ids must be whole numbers."""
    if not path.exists():
        return {}
    gen = read_json(path)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = gen.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 24 for i in ids
        ):
            raise CheckpointError(
                f"{path}: {key} must be a token id or a list of them, not {value!r:.60}"
            )
    return gen


def shard_files(index: Path, folder: Path) -> list[Path]:
    """The safetensors shards listed in ``index``, each one inside ``folder``.

    A shard name must be a plain relative path (no ``..``, not absolute) ending in
    ``.safetensors``, and must resolve inside the folder, or, for a Hugging Face cache snapshot
    (whose files are links into the repository's ``blobs``), inside that ``blobs`` folder.
    """
    weight_map = read_json(index, MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map object naming the shards")
    names = set(weight_map.values())
    if len(names) > MAX_SHARDS:
        raise CheckpointError(f"{index} lists {len(names):,} shards, over {MAX_SHARDS:,}")
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots":  # huggingface_hub's cache layout
        roots.append(root.parent.parent / "blobs")
    files = []
    for name in sorted(names, key=str):
        if not isinstance(name, str):
            raise CheckpointError(f"{index} names a shard by {name!r:.40}, not a file name")
        pure = PurePosixPath(name)
        if (
            pure.is_absolute()
            or "\\" in name
            or ".." in pure.parts
            or not name.endswith(".safetensors")
        ):
            raise CheckpointError(
                f"{index} lists the shard {name!r:.100}, which is not a .safetensors file "
                "inside the checkpoint folder; refusing to read it"
            )
        file = folder / pure
        if not file.exists():
            raise CheckpointNotFoundError(f"{file} is listed in the index but missing")
        real = file.resolve()
        if not any(real.is_relative_to(r) for r in roots):
            raise CheckpointError(
                f"{file} is a link to {real}, outside the checkpoint folder; refusing to read it"
            )
        files.append(file)
    return files


def read_safetensors(file: Path, pick: Callable | None = None) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, memory-mapped; any failure names the file.

    ``pick(name, lazy_slice)`` (tensor parallelism) returns the part of a tensor to read, or
    None to skip it: only those bytes are read from the mapped file.
    """
    from safetensors import SafetensorError, safe_open

    tensors = {}
    try:
        with safe_open(file, framework="pt") as f:  # memory-mapped: no copy when dtypes match
            for name in f.keys():
                if pick is None:
                    tensors[name] = f.get_tensor(name)
                elif (part := pick(name, f.get_slice(name))) is not None:
                    tensors[name] = part
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{file} is not a valid safetensors file ({err}); it may be truncated: "
            "download or convert it again"
        ) from None
    for name, tensor in tensors.items():
        if not tensor.dtype.is_floating_point and tensor.dtype not in _WEIGHT_INTS:
            raise CheckpointError(
                f"{file}: tensor {name} is {tensor.dtype}, which no Gemma weight is"
            )
    return tensors


def check_weight_dtype(name: str, tensor: torch.Tensor, want: torch.dtype) -> None:
    """A float parameter needs float weights (an int tensor would fail only when run)."""
    if want.is_floating_point and not tensor.dtype.is_floating_point:
        raise CheckpointError(
            f"tensor {name} is {tensor.dtype} but the model needs floating-point weights there; "
            "the checkpoint does not match its config.json"
        )
