"""Bad input gets a specific, actionable error; the CLI prints one line and exits 2."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gemma_engine import (
    CheckpointError,
    CheckpointNotFoundError,
    Engine,
    UnsupportedModelError,
)
from gemma_engine.cli import main


@pytest.fixture
def folder(tmp_path, tiny_checkpoints) -> Path:
    """A fresh, writable copy of the tiny Gemma 3 checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["gemma3"][0], dst)
    return dst


def edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def load(folder) -> Engine:
    return Engine.from_pretrained(folder, compile=False, max_seq_len=32)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such folder"):
        load(tmp_path / "nope")


def test_unsupported_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gemma, gemma2, gemma3_text, gemma3"):
        load(folder)


def test_missing_tensor(folder):
    edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        load(folder)


def test_unexpected_tensor(folder):
    edit_weights(folder, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected .*model\.layers\.9\.extra\.weight"):
        load(folder)


def test_misshapen_tensor(folder):
    name = "model.layers.0.self_attn.k_proj.weight"
    edit_weights(folder, lambda t: t.update({name: torch.zeros(3, 64)}))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(3, 64\)"):
        load(folder)


def test_truncated_safetensors(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load(folder)


class _Boom:
    """Unpickling this would create a file: proof of code execution."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_checkpoint_is_refused_unopened(folder, tmp_path):
    marker = tmp_path / "pwned"
    boom = _Boom()
    boom.marker = marker
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(boom))
    with pytest.raises(CheckpointError, match="pickle .*arbitrary code"):
        load(folder)
    with pytest.raises(CheckpointError, match="safetensors or GGUF"):
        load(folder / "pytorch_model.bin")
    assert not marker.exists()


def offline_hub(monkeypatch, cache: Path) -> None:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=cache, as huggingface_hub reads them at import."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def test_hub_id_while_offline(tmp_path, monkeypatch):
    offline_hub(monkeypatch, tmp_path / "hub")
    with pytest.raises(CheckpointNotFoundError, match="HF_HUB_OFFLINE is set"):
        load("google/gemma-3-270m")


def test_hub_id_from_offline_cache(tmp_path, monkeypatch, tiny_checkpoints):
    """A hub id resolves through huggingface_hub's cache layout, offline."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-gemma" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_checkpoints["gemma"][0], snapshot)
    (cache / "models--someone--tiny-gemma" / "refs").mkdir()
    (cache / "models--someone--tiny-gemma" / "refs" / "main").write_text("0" * 40)
    offline_hub(monkeypatch, cache)
    engine = load("someone/tiny-gemma")
    assert engine.config.model_type == "gemma"


def test_cli_bad_model_is_one_line(tmp_path, capsys):
    assert main(["--prompt", "hi", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gemma-run: error: ") and "not found" in err


def test_cli_bad_sampling_value_is_one_line(folder, capsys):
    code = main(["--prompt", "hi", "--model", str(folder), "--no-compile", "--top-p", "2"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "top_p" in err


def test_cli_prompt_too_long(folder, capsys):
    code = main(
        ["--prompt", "word " * 100, "--model", str(folder), "--no-compile", "--max-seq-len", "16"]
    )
    assert code == 2
    assert "max_seq_len" in capsys.readouterr().err


def test_cli_bad_flag_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "gemma_engine.cli", "--prompt", "x", "--max-new-tokens", "many"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--max-new-tokens" in proc.stderr


def test_cli_streams_text_and_summary(folder, capsys):
    assert (
        main(
            [
                "--prompt",
                "The quick",
                "--model",
                str(folder),
                "--no-compile",
                "--max-new-tokens",
                "8",
                "--seed",
                "1",
                "--temperature",
                "0.8",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    engine = load(folder)
    expected = engine.generate("The quick", max_new_tokens=8, seed=1, temperature=0.8).text
    assert out == expected + "\n"
    assert "prompt tokens" in err and "tok/s" in err


def test_cli_reads_stdin_and_ctrl_c_exits_130(folder, monkeypatch, capsys):
    import io

    def interrupted(self, *args, **kwargs):
        yield "partial"
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    monkeypatch.setattr(Engine, "stream", interrupted)
    assert main(["--prompt", "-", "--model", str(folder), "--no-compile"]) == 130
    assert capsys.readouterr().out == "partial\n"


def test_cache_that_cannot_fit_in_memory(folder, monkeypatch):
    from gemma_engine import OutOfMemoryError

    monkeypatch.setattr("gemma_engine.engine.os.sysconf", lambda name: 16)  # 256 bytes free
    with pytest.raises(OutOfMemoryError, match="smaller max_seq_len"):
        load(folder)
