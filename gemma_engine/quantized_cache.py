"""Quantized weights kept between processes, so that a fresh process does not quantize again.

Quantizing the default model to int8 took ~1.1 s of a fresh ``gemma-run --quantize int8``
start on two cores (the 262,144 x 640 output layer alone 0.8 s), every time. The first process
that quantizes a checkpoint on a CPU keeps the result, the quantized tensors in the layout
``save_pretrained`` writes, in

    $GEMMA_ENGINE_CACHE (default ~/.cache/gemma-engine) /quantized/<entry>.safetensors

and a later one loads them instead (memory-mapped; the float weights they replace are then
never read). An entry is named by the checkpoint's path and the quantization (method, group
size, float dtype), so the folder holds one entry per checkpoint and mode, and its metadata
records what the tensors were computed from: the size, inode and modification and change times
of the checkpoint's files, torch's version and the quantizer's source. A checkpoint changed in
place, another torch or another quantizer makes the entry stale: the weights are quantized
again and the entry replaced. An entry that does not load as the model's quantized tensors
(damaged, cut short) is ignored with one warning line and replaced. Entries are written under a
temporary name and renamed; the least recently used are removed past ``KEEP_BYTES``.

Like the compiled graphs, the cache trusts what is in the user's own folder: safetensors are
read with bounds checks, never unpickled, but a byte changed inside a tensor is not detected
(hashing the tensors would cost what the cache saves). Remove the folder to start afresh.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from . import compile_cache, quant
from .errors import CheckpointError
from .file_checks import read_safetensors

FOLDER = "quantized"
KEEP_BYTES = 8 << 30  # the most recently used entries are kept up to this size (the newest always)
_CHECKPOINT_FILES = ("config.json", "model.safetensors.index.json")


def _source_files(path: Path) -> list[Path]:
    """The files the quantized weights derive from: a GGUF file, or a folder's config and
    safetensors shards (a hub snapshot's links resolve to its blobs)."""
    if path.is_file():
        return [path]
    return sorted(
        p for p in path.iterdir() if p.name in _CHECKPOINT_FILES or p.suffix == ".safetensors"
    )


def _describe(path: Path, method: str, group_size: int | None, dtype: torch.dtype) -> dict:
    files = []
    for file in _source_files(path):
        st = file.stat()
        files.append([file.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
    return {
        "source": str(path.resolve()),
        "files": files,
        "method": method,
        "group_size": group_size,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "quantizer": hashlib.sha256(Path(quant.__file__).read_bytes()).hexdigest(),
    }


class Entry:
    """The cache entry of one checkpoint (``path``, a folder or GGUF file) and quantization."""

    def __init__(self, path: Path, method: str, group_size: int | None, dtype: torch.dtype):
        try:
            self.description: dict | None = _describe(path, method, group_size, dtype)
        except OSError:  # a file gone since it was read: no entry to trust or keep
            self.description = None
        name = json.dumps([str(path.resolve()), method, group_size, str(dtype)])
        self.folder = compile_cache.root() / FOLDER
        self.file = self.folder / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.safetensors"

    def read(self) -> dict[str, torch.Tensor] | None:
        """The quantized tensors by the model's names (memory-mapped), or None when the entry
        is missing or stale. A damaged entry is warned about and treated as missing."""
        from safetensors import SafetensorError, safe_open

        if self.description is None:
            return None
        try:
            with safe_open(self.file, framework="pt") as f:
                found = (f.metadata() or {}).get("gemma_engine")
        except FileNotFoundError:
            return None
        except (SafetensorError, OSError) as err:
            self.warn(f"cannot be read ({err})")
            return None
        if found != json.dumps(self.description, sort_keys=True):
            return None  # computed from other files, by another torch or quantizer
        try:
            tensors = read_safetensors(self.file)
        except CheckpointError as err:
            self.warn(str(err))
            return None
        with contextlib.suppress(OSError):
            os.utime(self.file)  # most recently used
        return tensors

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (quantized, by the model's names) as this entry; nothing on failure
        beyond one warning line (a full disk or a read-only home must not fail a load)."""
        from safetensors.torch import save_file

        if self.description is None:
            return
        metadata = {"gemma_engine": json.dumps(self.description, sort_keys=True)}
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{self.file.name}.")
            os.close(fd)
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
            os.replace(tmp, self.file)
        except OSError as err:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            compile_cache.warn(
                f"cannot keep the quantized weights in {self.folder} ({err.strerror or err}); "
                "the next process quantizes them again"
            )
            return
        # The least recently used entries past KEEP_BYTES go; the newest always stays.
        compile_cache.remove_least_recent(
            list(self.folder.glob("*.safetensors")), KEEP_BYTES, keep=self.file
        )

    def warn(self, why: str) -> None:
        compile_cache.warn(
            f"the quantized-weight cache entry {self.file} {why}; it is ignored and rebuilt"
        )


def quantized_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The quantized modules' tensors of ``model`` by state-dict name, in the saved layout."""
    return {
        f"{path}.{name}": t
        for path, module in model.named_modules()
        if isinstance(module, quant.QuantizedLinear)
        for name, t in module.saved_tensors().items()
    }
