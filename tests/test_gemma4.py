"""Gemma 4 against transformers 5.24 on tiny random checkpoints: dense and mixture of experts.

The dense checkpoint has k_eq_v full layers with their own head size and key/value heads,
proportional RoPE, per-layer embeddings, KV sharing and double-wide MLPs on the shared layers;
the MoE one has experts beside the dense MLP on every layer. Both have a window of 8, shorter
than the sequences, perturbed norm weights around 1 and explicit layer_scalar values.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_decode import incremental_logits
from torch._dynamo.utils import counters

from gemma_engine import CheckpointError, Engine, GemmaConfig, UnsupportedModelError, quant
from gemma_engine.config import AttentionType
from gemma_engine.errors import InvalidRequestError, OutOfMemoryError

KINDS = ["gemma4", "gemma4_moe"]
BUCKETS = [8, 16, 32, 64]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(folder, compile: bool = False, **kwargs) -> Engine:
    kwargs = {"max_seq_len": 128, "buckets": [16, 32, 64], **kwargs}
    return Engine.from_pretrained(folder, compile=compile, **kwargs)


@pytest.fixture(scope="module")
def engines(tiny_new_checkpoints) -> dict[str, Engine]:
    return {kind: load(tiny_new_checkpoints[kind][0]) for kind in KINDS}


def test_config_has_every_gemma4_feature(engines):
    dense, moe = engines["gemma4"].config, engines["gemma4_moe"].config
    full = [i for i, t in enumerate(dense.layer_types) if t is AttentionType.GLOBAL]
    assert full == [2, 5]
    assert [s.head_dim for s in dense.layers] == [16, 16, 32, 16, 16, 32]
    assert [s.num_key_value_heads for s in dense.layers] == [2, 2, 1, 2, 2, 1]
    assert [s.k_eq_v for s in dense.layers] == [False, False, True, False, False, True]
    assert [s.kv_source for s in dense.layers] == [0, 1, 2, 3, 3, 2]  # 4, 5 read 3 and 2
    assert [s.intermediate_size for s in dense.layers] == [128] * 4 + [256] * 2  # double-wide
    assert dense.rope_global.partial_rotary_factor == 0.25 and dense.rope_global.theta == 1e6
    assert dense.hidden_size_per_layer_input == 16 and dense.layer_scalar
    assert dense.norm_offset == 0.0 and dense.v_norm and dense.query_pre_attn_scalar == 1.0
    assert dense.final_logit_softcapping == 30.0 and dense.sliding_window == 8
    assert moe.num_experts == 8 and moe.top_k_experts == 2 and moe.hidden_size_per_layer_input == 0
    assert all(s.kv_source == i for i, s in enumerate(moe.layers))


@pytest.mark.parametrize("kind", KINDS)
def test_score_matches_transformers(kind, engines, tiny_new_checkpoints):
    reference = tiny_new_checkpoints[kind][1]
    for seed, length in [(0, 7), (1, 40), (2, 100)]:  # 40 and 100 wrap the 8-slot ring
        ids = random_ids(length, seed)
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        got = engines[kind].score(ids)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_matches_transformers(kind, compiled, engines, tiny_new_checkpoints):
    folder, reference = tiny_new_checkpoints[kind]
    # Compiled: one bucket for every position, so one graph to build.
    engine = load(folder, compile=True, max_seq_len=64, buckets=[64]) if compiled else engines[kind]
    for seed in range(2):
        prompt = random_ids(5 + 9 * seed, seed)
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False
        )[0, len(prompt) :].tolist()
        got = engine.generate(prompt, max_new_tokens=40)
        # The reference never stops (min_new_tokens); ours may stop at an EOS.
        assert got.token_ids == expected[: len(got.token_ids)]
        assert len(got.token_ids) >= 32 or got.finish_reason == "stop"
        assert len(got.token_ids) == 40 or got.token_ids[-1] in engine.eos_token_ids


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_moe_incremental_equals_full_forward(compiled, tiny_new_checkpoints):
    """Decode gathers each token's experts (fixed shapes); a prompt groups tokens by expert.
    Both give one forward's logits, in every bucket, with one graph per bucket."""
    folder = tiny_new_checkpoints["gemma4_moe"][0]
    torch._dynamo.reset()
    engine = Engine.from_pretrained(folder, compile=compiled, max_seq_len=64, buckets=BUCKETS)
    ids = random_ids(40, 3)
    full = engine.score(ids)
    graphs = counters["stats"]["unique_graphs"]
    got = incremental_logits(engine, ids, prompt_len=5)
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)
    if compiled:  # positions 5..39 touch buckets 8, 16, 32 and 64
        # At most four traced: none when a graph was found saved whole (saved_graphs.py).
        assert counters["stats"]["unique_graphs"] - graphs <= 4
        assert sorted(engine.compile_seconds) == [(1, b) for b in BUCKETS]


def test_kv_shared_layers_own_no_cache(engines, tiny_new_checkpoints):
    engine = engines["gemma4"]
    caches = [layer.self_attn.cache for layer in engine.model.model.layers]
    assert [c is None for c in caches] == [False] * 4 + [True] * 2
    # 128 positions: sliding layers hold a ring of min(8 + min(512, 32), 128) entries (the
    # window and model.RING_SLACK), full layers 128, at their own geometry, for each of
    # max_batch rows.
    per_slot = {0: 2 * 16, 1: 2 * 16, 2: 1 * 32, 3: 2 * 16}
    slots = {0: 40, 1: 40, 2: 128, 3: 40}
    rows = engine.max_batch
    assert rows == 4  # the default, which fits easily
    assert engine.kv_cache_bytes == rows * sum(2 * per_slot[i] * slots[i] * 4 for i in range(4))
    small = load(tiny_new_checkpoints["gemma4"][0], max_seq_len=64, prefill_chunk=4, max_batch=2)
    slots = {0: 12, 1: 12, 2: 64, 3: 12}
    assert small.kv_cache_bytes == 2 * sum(2 * per_slot[i] * slots[i] * 4 for i in range(4))


def test_memory_check_counts_only_cache_owners(tiny_new_checkpoints, monkeypatch):
    """The cache of 200 positions is 3 * 6 KiB (rings of 8 + 4) + 50 KiB: let only a little
    more than that be free, which six cache-owning layers would not fit in, nor two rows.
    With max_batch left to its default, the engine then holds one row."""
    import os

    folder = tiny_new_checkpoints["gemma4"][0]
    need = 3 * (2 * 12 * 2 * 16 * 4) + 2 * 200 * 1 * 32 * 4  # three sliding layers, one full
    page = os.sysconf("SC_PAGE_SIZE")
    real = os.sysconf
    monkeypatch.setattr(
        os, "sysconf", lambda k: int(need / 0.8 / page) + 1 if k == "SC_AVPHYS_PAGES" else real(k)
    )
    assert load(folder, max_seq_len=200, buckets=[200], prefill_chunk=4).max_batch == 1  # fits
    with pytest.raises(OutOfMemoryError, match="max_batch"):
        load(folder, max_seq_len=200, buckets=[200], prefill_chunk=4, max_batch=2)
    monkeypatch.setattr(
        os, "sysconf", lambda k: int(need / 0.8 / page) - 1 if k == "SC_AVPHYS_PAGES" else real(k)
    )
    with pytest.raises(OutOfMemoryError, match="max_seq_len"):
        load(folder, max_seq_len=200, buckets=[200], prefill_chunk=4)


def test_hub_form_of_the_geometry_parses_the_same(tiny_new_checkpoints):
    """The hub writes global_head_dim / num_global_key_value_heads; transformers 5.24 saves
    per_layer_config. Both give the same config."""
    saved = json.loads((tiny_new_checkpoints["gemma4"][0] / "config.json").read_text())
    assert "per_layer_config" in saved and "global_head_dim" not in saved
    hub = {k: v for k, v in saved.items() if k != "per_layer_config"}
    hub.update(global_head_dim=32, num_global_key_value_heads=1)
    assert GemmaConfig.from_hf(hub) == GemmaConfig.from_hf(saved)
    # Without attention_k_eq_v, full layers keep num_key_value_heads (transformers' rule).
    no_kv = GemmaConfig.from_hf({**hub, "attention_k_eq_v": False})
    assert [s.num_key_value_heads for s in no_kv.layers] == [2] * 6
    assert not any(s.k_eq_v for s in no_kv.layers)
    # The multimodal wrapper nests the same text config.
    wrapped = {"model_type": "gemma4", "text_config": saved, "vision_config": {}}
    assert GemmaConfig.from_hf(wrapped) == GemmaConfig.from_hf(saved)


@pytest.mark.parametrize(
    "edit, error, words",
    [
        ({"use_bidirectional_attention": "all"}, UnsupportedModelError, "use_bidirectional"),
        ({"per_layer_config": {"2": {"sliding_window": 4}}}, UnsupportedModelError, "sliding_win"),
        ({"per_layer_config": {"9": {"head_dim": 32}}}, CheckpointError, "per_layer_config"),
        ({"num_kv_shared_layers": 6}, CheckpointError, "num_kv_shared_layers"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn"}}},
            UnsupportedModelError,
            "yarn",
        ),
        ({"enable_moe_block": True, "num_experts": None}, CheckpointError, "num_experts"),
        ({"attention_bias": True}, UnsupportedModelError, "attention_bias"),
    ],
)
def test_unsupported_configs_are_refused_by_name(tiny_new_checkpoints, edit, error, words):
    saved = json.loads((tiny_new_checkpoints["gemma4"][0] / "config.json").read_text())
    with pytest.raises(error, match=words):
        GemmaConfig.from_hf({**saved, **edit})


def test_chat_prompt_uses_gemma4_turns(engines, json_tokenizer_file):
    from transformers import AutoTokenizer

    engine = engines["gemma4"]
    reference = AutoTokenizer.from_pretrained(json_tokenizer_file.parent)
    text = "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\n"
    expected = reference.encode(text, add_special_tokens=False)  # parses the markers
    assert engine.chat_prompt("Hi there", system="Be brief.") == expected
    no_system = text.replace("<|turn>system\nBe brief.<turn|>\n", "")
    assert engine.chat_prompt("Hi there") == reference.encode(no_system, add_special_tokens=False)
    # User text cannot close the turn: the marker in it is text, not the marker's id.
    assert engine.chat_prompt("a<turn|>b").count(engine.tokenizer.special_id("<turn|>")) == 1
    assert engine.tokenizer.special_id("<turn|>") in engine.eos_token_ids


def test_generation_config_eos_ids_stop_generation(tiny_new_checkpoints, tmp_path):
    """EOS ids come from generation_config.json (Gemma 4's lists several)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_new_checkpoints["gemma4"][0], folder)
    engine = load(folder)
    prompt = random_ids(6, 7)
    tokens = engine.generate(prompt, max_new_tokens=12).token_ids
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, tokens[4], 50]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    engine = load(folder)
    assert {1, tokens[4], 50} <= engine.eos_token_ids
    out = engine.generate(prompt, max_new_tokens=12)
    assert out.token_ids == tokens[: tokens.index(tokens[4]) + 1] and out.finish_reason == "stop"


def multimodal_checkpoint(text_folder, reference, folder):
    """A Gemma4ForConditionalGeneration checkpoint (tiny vision and audio towers) holding the
    text model's weights, plus the unused key/value tensors of KV-shared layers that real
    checkpoints carry."""
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
    )

    text = json.loads((text_folder / "config.json").read_text())
    vision = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    audio = Gemma4AudioConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32
    )
    config = Gemma4Config(
        text_config=text, vision_config=vision.to_dict(), audio_config=audio.to_dict()
    )
    torch.manual_seed(1)
    model = Gemma4ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(reference.model.state_dict())
    model.save_pretrained(folder, safe_serialization=True)
    tensors = load_file(folder / "model.safetensors")
    prefixes = {name.split(".")[1] for name in tensors}
    assert {"vision_tower", "audio_tower", "embed_vision", "embed_audio"} <= prefixes
    for i in (4, 5):  # shared layers: present in real files, ignored by transformers
        for part, rows in (("k_proj", 32), ("v_proj", 32)):
            tensors[f"model.language_model.layers.{i}.self_attn.{part}.weight"] = torch.randn(
                rows, 64
            )
        tensors[f"model.language_model.layers.{i}.self_attn.k_norm.weight"] = torch.randn(16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text_folder / name, folder / name)
    return folder


def test_multimodal_layout_loads_the_text_model(engines, tiny_new_checkpoints, tmp_path):
    text_folder, reference = tiny_new_checkpoints["gemma4"]
    folder = multimodal_checkpoint(text_folder, reference, tmp_path / "mm")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gemma4"
    ids = random_ids(30, 5)
    torch.testing.assert_close(
        load(folder).score(ids), engines["gemma4"].score(ids), atol=0, rtol=0
    )
    # Everything else stays strict: a missing text tensor is an error that names it.
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.language_model.layers.3.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.v_proj\.weight"):
        load(folder)


def dequantized_reference(engine: Engine, reference):
    """A copy of the transformers model holding the engine's quantized weights, expanded."""
    import copy

    ref = copy.deepcopy(reference)
    state = {
        f"{name}.weight": module.dequantize(torch.float32)
        for name, module in engine.model.named_modules()
        if isinstance(module, quant.QuantizedLinear)
    }
    result = ref.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    return ref.eval(), set(state)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_gemma4_matches_transformers_on_its_weights(
    method, tiny_new_checkpoints, monkeypatch
):
    monkeypatch.setattr(quant, "_cpu_bf16_matmul", lambda: False)  # fp32 prompt matmuls
    folder, reference = tiny_new_checkpoints["gemma4"]
    engine = load(folder, quantize=method)
    ref, quantized = dequantized_reference(engine, reference)
    # The per-layer embedding table and every new linear layer are quantized.
    assert {"model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight"} <= (
        quantized
    )
    assert "model.layers.0.per_layer_input_gate.weight" in quantized
    assert "model.layers.4.mlp.gate_proj.weight" in quantized
    ids = random_ids(30, 9)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.score(ids), expected, atol=1e-4, rtol=0)


def test_quantized_compiled_decode_matches_transformers(tiny_new_checkpoints, monkeypatch):
    """int8 decode kernels on the per-layer table and the new layers, in the compiled step."""
    monkeypatch.setattr(quant, "_cpu_bf16_matmul", lambda: False)
    folder, reference = tiny_new_checkpoints["gemma4"]
    engine = load(folder, compile=True, max_seq_len=64, buckets=[64], quantize="int8")
    ref, _ = dequantized_reference(engine, reference)
    prompt = random_ids(6, 11)
    expected = ref.generate(
        torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False
    )[0, len(prompt) :].tolist()
    got = engine.generate(prompt, max_new_tokens=32)
    assert got.stats["buckets_compiled"] == [64]
    assert got.token_ids == expected[: len(got.token_ids)] and len(got.token_ids) >= 16


def test_quantizing_experts_is_refused(tiny_new_checkpoints):
    with pytest.raises(InvalidRequestError, match="experts"):
        load(tiny_new_checkpoints["gemma4_moe"][0], quantize="int8")


def test_cli_chat_with_a_system_prompt(engines, tiny_new_checkpoints, capsys):
    from gemma_engine.cli import main

    folder = tiny_new_checkpoints["gemma4"][0]
    args = ["--prompt", "Hi", "--model", str(folder), "--no-compile", "--max-new-tokens", "6"]
    assert main([*args, "--chat", "--system", "Be brief."]) == 0
    engine = engines["gemma4"]
    expected = engine.generate(engine.chat_prompt("Hi", system="Be brief."), max_new_tokens=6)
    assert capsys.readouterr().out == expected.text + "\n"
    with pytest.raises(SystemExit) as exit:
        main([*args, "--system", "Be brief."])
    assert exit.value.code == 2 and "--system needs --chat" in capsys.readouterr().err


def test_save_pretrained_round_trips(engines, tmp_path):
    engine = engines["gemma4"]
    folder = engine.save_pretrained(tmp_path / "saved")
    assert (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").exists()
    ids = random_ids(20, 12)
    torch.testing.assert_close(load(folder).score(ids), engine.score(ids), atol=0, rtol=0)
