"""Quantized weights kept between loads (quantized_cache.py).

A second quantized load of a checkpoint reads the first one's quantized tensors instead of
quantizing: the test proves it by making quantization fail, and compares the model with the
one quantization built (itself checked against transformers in test_quant.py). A changed
checkpoint, a damaged entry or an entry for another model is quantized again, never used.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gemma_engine import Engine, quant, quantized_cache

KIND = "gemma3"
PROMPT = [2, 17, 99, 305, 41]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("GEMMA_ENGINE_CACHE", str(root))
    return root / quantized_cache.FOLDER


@pytest.fixture
def checkpoint(tiny_checkpoints, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoints[KIND][0], folder)
    return folder


def load(folder, method="int8", **kw):
    return Engine.from_pretrained(
        folder, compile=False, quantize=method, max_seq_len=32, max_batch=1, **kw
    )


def no_quantizing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(quant, "quantize_int8", refuse)
    monkeypatch.setattr(quant, "quantize_int4", refuse)


def state(engine):
    return {k: v.clone() for k, v in engine.model.state_dict().items() if "cache" not in k}


def assert_same_model(a, b):
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    ids, pos = torch.tensor([PROMPT]), torch.arange(len(PROMPT))
    logits = [e.model(ids, pos, 32, all_logits=True) for e in (a, b)]
    assert torch.equal(*logits)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_second_load_reads_what_the_first_quantized(cache, checkpoint, monkeypatch, method):
    first = load(checkpoint, method)
    (entry,) = cache.glob("*.safetensors")
    kept = load_file(entry)
    assert kept.keys() == quantized_cache.quantized_tensors(first.model).keys()
    assert "model.embed_tokens.scale" in kept
    with monkeypatch.context() as m:
        no_quantizing(m)
        second = load(checkpoint, method)
    assert second.quantization == first.quantization
    assert_same_model(first, second)
    assert list(cache.glob("*.safetensors")) == [entry]


def test_each_mode_has_its_entry_and_float_weights_none(cache, checkpoint):
    load(checkpoint, "int8")
    load(checkpoint, "int4", group_size=8)
    load(checkpoint, "int4")
    Engine.from_pretrained(checkpoint, compile=False, max_seq_len=32, max_batch=1)
    assert len(list(cache.glob("*.safetensors"))) == 3


def test_a_changed_checkpoint_is_quantized_again(cache, checkpoint, tiny_checkpoints):
    first = load(checkpoint)
    weights = load_file(checkpoint / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name] * 2  # same size, same names: only the file's times differ
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    changed = load(checkpoint)
    layer = changed.model.model.layers[0].mlp.down_proj
    expect = quant.quantize_int8(weights[name])
    got = layer.saved_tensors()
    assert torch.equal(got["weight"], expect[0]) and torch.equal(got["scale"], expect[1])
    assert not torch.equal(got["scale"], first.model.model.layers[0].mlp.down_proj.scale)
    assert len(list(cache.glob("*.safetensors"))) == 1  # the entry was replaced


def test_a_damaged_entry_is_ignored_with_one_warning_and_rebuilt(
    cache, checkpoint, monkeypatch, capsys
):
    first = load(checkpoint)
    (entry,) = cache.glob("*.safetensors")
    good = entry.read_bytes()
    capsys.readouterr()
    entry.write_bytes(good[: len(good) // 2])  # cut short
    again = load(checkpoint)
    (line,) = capsys.readouterr().err.splitlines()
    assert str(entry) in line and "it is ignored and rebuilt" in line
    assert_same_model(first, again)
    assert entry.read_bytes() == good  # rebuilt
    with monkeypatch.context() as m:
        no_quantizing(m)
        load(checkpoint)
    assert capsys.readouterr().err == ""


def test_an_entry_that_does_not_fit_the_model_is_rebuilt(cache, checkpoint, capsys):
    """Right metadata, wrong tensors (one missing): refused by the strict load, then rebuilt."""
    first = load(checkpoint)
    (entry,) = cache.glob("*.safetensors")
    from safetensors import safe_open

    with safe_open(entry, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(entry)
    del tensors["model.layers.1.self_attn.q_proj.scale"]
    save_file(tensors, entry, metadata=metadata)
    capsys.readouterr()
    again = load(checkpoint)
    (line,) = capsys.readouterr().err.splitlines()
    assert "does not fit this model" in line and "q_proj.scale" in line
    assert_same_model(first, again)
    assert load_file(entry).keys() == quantized_cache.quantized_tensors(first.model).keys()


def test_a_cache_that_cannot_be_written_warns_once_and_loads(
    tmp_path, monkeypatch, checkpoint, capsys
):
    root = tmp_path / "cache"
    root.mkdir()
    (root / quantized_cache.FOLDER).write_text("a file where the folder would be")
    monkeypatch.setenv("GEMMA_ENGINE_CACHE", str(root))
    engine = load(checkpoint)
    (line,) = capsys.readouterr().err.splitlines()
    assert "cannot keep the quantized weights" in line
    assert engine.quantization == ("int8", None)


def test_the_least_recently_used_entries_go_past_the_limit(cache, checkpoint, monkeypatch):
    monkeypatch.setattr(quantized_cache, "KEEP_BYTES", 1)  # only the newest entry stays
    load(checkpoint, "int8")
    (first,) = cache.glob("*.safetensors")
    load(checkpoint, "int4")
    (second,) = cache.glob("*.safetensors")
    assert second != first


def test_the_int8_draft_shares_the_int8_models_entry(cache, checkpoint, monkeypatch):
    """speculate="int8" drafts with the matrices quantize="int8" makes of the same checkpoint:
    whichever process comes first keeps them, the others read them."""

    def drafting():
        engine = Engine.from_pretrained(
            checkpoint, compile=False, max_seq_len=32, max_batch=1, speculate="int8"
        )
        return engine.speculator.drafter.engine

    first = drafting()
    assert len(list(cache.glob("*.safetensors"))) == 1
    with monkeypatch.context() as patch:
        no_quantizing(patch)
        int8, again = load(checkpoint), drafting()
    assert len(list(cache.glob("*.safetensors"))) == 1
    assert_same_model(int8, first)
    assert_same_model(again, first)
