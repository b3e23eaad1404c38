"""Gemma 3n against transformers 5.24 on a tiny random checkpoint.

The checkpoint has AltUp (4 streams), LAuReL, gaussian top-k activation sparsity on its first
two layers, per-layer MLP widths, KV sharing, per-layer embeddings from a table shorter than
the vocabulary (ids 480-511 read row 0), a window of 8 and norm weights perturbed around 1.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_decode import incremental_logits

from gemma_engine import CheckpointError, Engine, GemmaConfig, quant


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tiny_new_checkpoints):
    return tiny_new_checkpoints["gemma3n"]


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.from_pretrained(checkpoint[0], compile=False, max_seq_len=128, buckets=[16, 64])


def test_config_has_every_gemma3n_feature(engine):
    cfg = engine.config
    assert cfg.altup_num_inputs == 4 and cfg.altup_correct_scale and cfg.laurel_rank == 8
    assert [s.intermediate_size for s in cfg.layers] == [128, 128, 96, 96, 128, 128]
    assert [s.activation_sparsity for s in cfg.layers] == [0.95, 0.95, 0, 0, 0, 0]
    assert [s.kv_source for s in cfg.layers] == [0, 1, 2, 1, 1, 2]  # 3 shared layers
    assert cfg.vocab_size_per_layer_input == 480 < cfg.vocab_size
    assert cfg.norm_offset == 0.0 and cfg.v_norm and cfg.query_pre_attn_scalar == 1.0
    assert not cfg.layer_scalar and not cfg.num_experts
    assert (cfg.rope_global.theta, cfg.rope_local.theta) == (1e6, 1e4)


def test_score_matches_transformers(engine, checkpoint):
    reference = checkpoint[1]
    for seed, length in [(0, 7), (1, 40), (2, 100)]:
        ids = random_ids(length, seed)
        ids[3] = 500  # beyond the per-layer table
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(engine.score(ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_greedy_generate_matches_transformers(compiled, engine, checkpoint):
    folder, reference = checkpoint
    if compiled:
        engine = Engine.from_pretrained(folder, compile=True, max_seq_len=64, buckets=[64])
    for seed in range(2):
        prompt = random_ids(5 + 9 * seed, seed)
        prompt[1] = 505
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False
        )[0, len(prompt) :].tolist()
        got = engine.generate(prompt, max_new_tokens=40)
        assert got.token_ids == expected[: len(got.token_ids)]
        assert len(got.token_ids) >= 32 or got.finish_reason == "stop"


def test_incremental_equals_full_forward(checkpoint):
    engine = Engine.from_pretrained(
        checkpoint[0], compile=False, max_seq_len=64, buckets=[8, 16, 64]
    )
    ids = random_ids(40, 4)
    got = incremental_logits(engine, ids, prompt_len=5)
    torch.testing.assert_close(got, engine.score(ids), atol=1e-4, rtol=0)


def test_hub_style_config_keys(checkpoint):
    """Hub Gemma 3n configs use rope_theta / rope_local_base_freq and list every key; keys
    they leave out take transformers' class defaults."""
    saved = json.loads((checkpoint[0] / "config.json").read_text())
    hub = {k: v for k, v in saved.items() if k != "rope_parameters"}
    hub.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)
    assert GemmaConfig.from_hf(hub) == GemmaConfig.from_hf(saved)
    wrapped = {"model_type": "gemma3n", "text_config": saved, "audio_config": {}}
    assert GemmaConfig.from_hf(wrapped) == GemmaConfig.from_hf(saved)
    sparse = {k: v for k, v in saved.items() if k not in ("final_logit_softcapping", "laurel_rank")}
    defaults = GemmaConfig.from_hf({**sparse, "activation_sparsity_pattern": None})
    assert defaults.final_logit_softcapping == 30.0 and defaults.laurel_rank == 64
    assert [s.activation_sparsity for s in defaults.layers] == [0.0] * 6  # only past 10 layers
    with pytest.raises(CheckpointError, match="intermediate_size"):
        GemmaConfig.from_hf({**saved, "intermediate_size": [128, 128]})
    with pytest.raises(CheckpointError, match="activation_sparsity_pattern"):
        GemmaConfig.from_hf({**saved, "activation_sparsity_pattern": [0.95]})


def test_chat_keeps_gemma3_turns(engine):
    tok = engine.tokenizer
    ids = engine.chat_prompt("Hi", system="Be brief.")
    start, end = tok.special_id("<start_of_turn>"), tok.special_id("<end_of_turn>")
    assert ids[:2] == [tok.bos_id, start] and ids.count(start) == 2 and ids.count(end) == 1
    assert tok.decode(ids) == "user\nBe brief.\n\nHi\nmodel\n"  # markers decode to nothing
    assert end in engine.eos_token_ids


def test_int8_covers_the_new_layers(checkpoint, monkeypatch):
    """AltUp's projections, LAuReL and the per-layer table are quantized; AltUp's tiny
    coefficient maps stay float; the result is the model its weights describe."""
    import copy

    monkeypatch.setattr(quant, "_cpu_bf16_matmul", lambda: False)
    folder, reference = checkpoint
    engine = Engine.from_pretrained(folder, compile=False, max_seq_len=64, quantize="int8")
    state = {
        f"{name}.weight": module.dequantize(torch.float32)
        for name, module in engine.model.named_modules()
        if isinstance(module, quant.QuantizedLinear)
    }
    for name in (
        "model.altup_projections.0.weight",
        "model.embed_tokens_per_layer.weight",
        "model.layers.0.laurel.linear_left.weight",
        "model.layers.0.altup.prediction_coefs.weight",
    ):
        assert (name in state) == ("coefs" not in name), name
    ref = copy.deepcopy(reference)
    assert not ref.load_state_dict(state, strict=False).unexpected_keys
    ids = random_ids(30, 8)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.score(ids), expected, atol=1e-4, rtol=0)
