"""Soak: loading and dropping a checkpoint hundreds of times in one process leaks nothing.

Each round loads a tiny checkpoint (safetensors folder, GGUF file, or a malformed file that
fails), generates a token where it loaded, and drops everything. Resident memory is sampled
(after ``gc.collect`` and glibc's ``malloc_trim``, which return freed memory so that only
live memory counts) once the first rounds have warmed caches up, and again at the end.

The bound, 24 MiB over 270 rounds: the Gemma 3 checkpoint used here holds ~0.9 MiB of fp32
weights, so keeping one copy of the weights per load would grow RSS by ~240 MiB, ten times the
bound; so would keeping anything of comparable size. Memory maps (safetensors and GGUF are
mmapped) are counted too: their number must come back to where it was.
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest
from hostile import tiny_gguf

from gemma_engine import CheckpointError, Engine

ROUNDS = 300
WARMUP = 30
BOUND_MIB = 24


def _rss_mib() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: measure as it is
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _soak(load_once) -> tuple[float, int]:
    """(RSS growth in MiB, growth in memory maps) between the warm-up and the last round."""
    for _ in range(WARMUP):
        load_once()
    rss, maps = _rss_mib(), _maps()
    for _ in range(ROUNDS - WARMUP):
        load_once()
    return _rss_mib() - rss, _maps() - maps


def _load_and_generate(path: Path) -> None:
    engine = Engine.from_pretrained(path, device="cpu", compile=False, max_seq_len=32)
    engine.generate([engine.tokenizer.bos_id], max_new_tokens=1)
    del engine


@pytest.mark.parametrize("kind", ["safetensors", "gguf", "malformed"])
def test_load_and_drop_leaks_nothing(kind, tiny_checkpoints, tmp_path) -> None:
    # ~300 loads of a tiny model: ~5-15 s per kind on 2 cores.
    if kind == "safetensors":
        path = tiny_checkpoints["gemma3"][0]
    else:
        path = tmp_path / "tiny.gguf"
        data = tiny_gguf().build()
        path.write_bytes(data if kind == "gguf" else data[: len(data) - 1])  # cut: an error

    def once() -> None:
        if kind == "malformed":
            with pytest.raises(CheckpointError):
                _load_and_generate(path)
        else:
            _load_and_generate(path)

    growth, maps = _soak(once)
    print(f"{kind}: RSS {growth:+.1f} MiB, {maps:+d} maps over {ROUNDS - WARMUP} loads")
    assert growth < BOUND_MIB, f"RSS grew {growth:.1f} MiB over {ROUNDS - WARMUP} loads"
    assert maps <= 2, f"{maps} memory maps were left behind"
