"""A corpus of malformed checkpoints, generated here: each must end, fast, in a CheckpointError.

Every case starts from a tiny checkpoint that loads and generates (the baselines below prove
it), changes one thing, and is loaded the way a user would (``Engine.from_pretrained``) in a
forked child under a 2 GiB address-space limit and a 5 s timeout (tests/hostile.py). A hang, a
crash, a MemoryError or any exception that is not a CheckpointError fails the case. The GGUF
cases follow llama.cpp's tests/test-gguf.cpp and the checks of its parser (see
../shared/notes/reliability.md); a handful also go through the real gemma-run command.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile import (
    ARR,
    F32,
    GGUF,
    I32,
    KV,
    STR,
    U8,
    U32,
    U64,
    gemma_run,
    kv,
    patch,
    tensor,
    tiny_folder,
    tiny_gguf,
)

# -- GGUF cases: each a function of (spec, its bytes) -> the malformed file's bytes -----------

GGUFCase = Callable[[GGUF, bytes], bytes]
GGUF_CASES: dict[str, GGUFCase] = {}


def gguf_case(name: str, fn: GGUFCase) -> None:
    assert name not in GGUF_CASES, name
    GGUF_CASES[name] = fn


def rebuilt(edit: Callable[[GGUF], None]) -> GGUFCase:
    """A case that edits the spec and writes it again (offsets recomputed)."""

    def fn(g: GGUF, data: bytes) -> bytes:
        edit(g)
        return g.build()

    return fn


def patched(field: str, fmt: str, value: int | Callable[[bytes], int]) -> GGUFCase:
    """A case that overwrites one field of the valid file in place."""

    def fn(g: GGUF, data: bytes) -> bytes:
        v = value(data) if callable(value) else value
        return patch(data, g.fields[field], fmt, v)

    return fn


# The original report: 68 bytes or so, one metadata array that claims 2^63 elements.
gguf_case(
    "issue_array_of_2^63",
    lambda g, d: (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", 4)
        + b"evil"
        + struct.pack("<IIQ", ARR, U8, 1 << 63)
        + bytes(16)
    ),
)

# Truncated at every section of the file.
for where, at in [
    ("empty", lambda g, d: 0),
    ("mid_magic", lambda g, d: 3),
    ("after_magic", lambda g, d: 4),
    ("mid_version", lambda g, d: 6),
    ("after_version", lambda g, d: 8),
    ("mid_counts", lambda g, d: 20),
    ("after_counts", lambda g, d: 24),
    ("mid_first_key", lambda g, d: g.fields["kv:general.architecture.keylen"] + 10),
    ("mid_string_value", lambda g, d: g.fields["kv:general.architecture.len"] + 9),
    ("mid_token_array", lambda g, d: g.fields["kv:tokenizer.ggml.tokens[100].len"] + 3),
    ("mid_scores", lambda g, d: g.fields["kv:tokenizer.ggml.scores[10].value"] + 2),
    ("before_tensor_infos", lambda g, d: g.fields["tensor_infos"]),
    ("mid_tensor_info", lambda g, d: g.fields["t:blk.0.attn_q.weight.dim1"] + 4),
    ("at_data_start", lambda g, d: g.fields["data"]),
    ("mid_data", lambda g, d: g.fields["data"] + 5000),
    ("one_byte_short", lambda g, d: len(d) - 1),
]:
    gguf_case(f"truncated_{where}", lambda g, d, at=at: d[: at(g, d)])

# Each count and length at 0, at the file's size and at 2^63.
for field in [
    "n_tensors",
    "n_kv",
    "kv:general.architecture.keylen",
    "kv:general.architecture.len",
    "kv:tokenizer.ggml.tokens.len",
    "kv:tokenizer.ggml.tokens[7].len",
    "kv:tokenizer.ggml.scores.len",
    "t:token_embd.weight.namelen",
]:
    for label, value in [("0", 0), ("filesize", len), ("2^63", 1 << 63)]:
        gguf_case(f"{field}={label}", patched(field, "<Q", value))

# Magic, version, value and tensor types.
gguf_case("bad_magic", lambda g, d: b"FUGG" + d[4:])
for version in (0, 1, 4, 0x03000000):  # the last: a big-endian file's version
    gguf_case(f"version_{version:#x}", patched("version", "<I", version))
for kind in (13, 1 << 31, 0xFFFFFFFF):
    gguf_case(f"kv_type_{kind:#x}", patched("kv:general.architecture.type", "<I", kind))
gguf_case("array_item_type_13", patched("kv:tokenizer.ggml.scores.item", "<I", 13))
gguf_case("array_of_arrays", patched("kv:tokenizer.ggml.scores.item", "<I", ARR))
for kind in (4, 99, 0xFFFFFFFF):  # 4: Q4_2, removed from ggml
    gguf_case(f"ggml_type_{kind:#x}", patched("t:output_norm.weight.type", "<I", kind))

# Alignment.
gguf_case("alignment_0", patched("kv:general.alignment.value", "<I", 0))
gguf_case("alignment_13", patched("kv:general.alignment.value", "<I", 13))
gguf_case("alignment_2^31", patched("kv:general.alignment.value", "<I", 1 << 31))
gguf_case(
    "alignment_as_int32",
    rebuilt(lambda g: setattr(kv(g, "general.alignment"), "type", I32)),
)

# Tensor data offsets.


def _shift_offset(name: str, by: int) -> GGUFCase:
    def fn(g: GGUF, data: bytes) -> bytes:
        at = g.fields[f"t:{name}.offset"]
        return patch(data, at, "<Q", struct.unpack_from("<Q", data, at)[0] + by)

    return fn


gguf_case("offset_unaligned", _shift_offset("blk.0.attn_norm.weight", 4))
gguf_case("offset_shifted_into_the_next", _shift_offset("blk.0.attn_q.weight", 32))
gguf_case("offset_past_eof", patched("t:blk.0.ffn_down.weight.offset", "<Q", 1 << 40))
gguf_case("offset_2^63", patched("t:blk.0.ffn_down.weight.offset", "<Q", (1 << 63) - 32))


def _swap_offsets(g: GGUF, data: bytes) -> bytes:
    a, b = g.fields["t:token_embd.weight.offset"], g.fields["t:output_norm.weight.offset"]
    (first,), (second,) = struct.unpack_from("<Q", data, a), struct.unpack_from("<Q", data, b)
    return patch(patch(data, a, "<Q", second), b, "<Q", first)


gguf_case("offsets_out_of_order", _swap_offsets)
gguf_case(
    "offsets_overlapping",
    lambda g, d: patch(
        d,
        g.fields["t:blk.0.attn_k.weight.offset"],
        "<Q",
        struct.unpack_from("<Q", d, g.fields["t:blk.0.attn_q.weight.offset"])[0] + 64,
    ),
)

# Shapes.
gguf_case(
    "five_dimensions",
    rebuilt(lambda g: tensor(g, "output_norm.weight").dims.extend([1, 1, 1, 1])),
)
gguf_case("zero_dimensions", rebuilt(lambda g: tensor(g, "output_norm.weight").dims.clear()))
gguf_case("dim_2^63", patched("t:blk.0.attn_norm.weight.dim0", "<Q", 1 << 63))
gguf_case(
    "dims_product_2^64",
    rebuilt(lambda g: setattr(tensor(g, "token_embd.weight"), "dims", [1 << 32, 1 << 32])),
)
# llama.cpp#18674: a dimension patched to 2^42+1 so that size * stride wraps.
gguf_case("dim_2^42+1", patched("t:token_embd.weight.dim1", "<Q", (1 << 42) + 1))
gguf_case(
    "q8_0_row_not_whole_blocks",
    rebuilt(lambda g: tensor(g, "blk.0.ffn_gate.weight").dims.__setitem__(0, 17)),
)
gguf_case(
    "shape_does_not_match_config",
    rebuilt(lambda g: setattr(tensor(g, "blk.0.attn_norm.weight"), "dims", [16])),
)

# Keys and names.
gguf_case(
    "duplicate_key",
    rebuilt(lambda g: g.kvs.append(KV("general.architecture", STR, "gemma"))),
)
gguf_case("empty_key", rebuilt(lambda g: setattr(g.kvs[-1], "key", "")))
gguf_case("key_not_utf8", rebuilt(lambda g: setattr(g.kvs[-1], "key", b"a\xff")))
gguf_case(
    "duplicate_tensor",
    rebuilt(lambda g: setattr(g.tensors[1], "name", g.tensors[0].name)),
)
gguf_case("empty_tensor_name", rebuilt(lambda g: setattr(g.tensors[1], "name", "")))
gguf_case("tensor_name_100_bytes", rebuilt(lambda g: setattr(g.tensors[1], "name", "x" * 100)))
gguf_case("unknown_tensor", rebuilt(lambda g: setattr(g.tensors[1], "name", "blk.0.evil.weight")))
gguf_case("missing_tensor", rebuilt(lambda g: g.tensors.pop()))


def _metadata(key: str, value, kind: int = U32, item: int | None = None) -> GGUFCase:
    """A case that sets (or adds) one metadata entry."""

    def edit(g: GGUF) -> None:
        entry = next((k for k in g.kvs if k.key == key), None)
        if entry is None:
            g.kvs.append(KV(key, kind, value, item))
        else:
            entry.type, entry.value, entry.item = kind, value, item

    return rebuilt(edit)


# Absurd architecture and vocabulary metadata: structurally valid, semantically not.
for key, value, kind in [
    ("gemma.attention.head_count", 0, U32),
    ("gemma.attention.head_count", 3, U32),  # hidden 32 = 3 heads x 16? no: shapes disagree
    ("gemma.block_count", 1_000_000, U32),
    ("gemma.block_count", 0xFFFFFFFF, U32),
    ("gemma.embedding_length", 0, U32),
    ("gemma.context_length", (1 << 63) - 1, U64),
    ("gemma.attention.key_length", 0, U32),
    ("gemma.feed_forward_length", 1 << 40, U64),
    ("gemma.block_count", "one", STR),
    ("gemma.attention.layer_norm_rms_epsilon", -1.0, F32),
    ("gemma.attention.layer_norm_rms_epsilon", float("nan"), F32),
    ("general.architecture", 7, U32),
    ("general.architecture", "llama", STR),
    ("tokenizer.ggml.model", "gpt2", STR),
    ("tokenizer.ggml.bos_token_id", 1_000_000, U32),
]:
    gguf_case(f"metadata_{key}={value!r:.20}", _metadata(key, value, kind))
gguf_case("metadata_scores_as_uint8", _metadata("tokenizer.ggml.scores", [0] * 262, ARR, U8))
gguf_case("metadata_token_type_99", _metadata("tokenizer.ggml.token_type", [99] * 262, ARR, I32))
gguf_case("metadata_tokens_not_an_array", _metadata("tokenizer.ggml.tokens", "a", STR))
gguf_case("metadata_fewer_scores", _metadata("tokenizer.ggml.scores", [0.0] * 10, ARR, F32))


def _vocab_edit(edit: Callable[[list[str]], None]) -> GGUFCase:
    def fn(g: GGUF) -> None:
        tokens = list(kv(g, "tokenizer.ggml.tokens").value)
        edit(tokens)
        kv(g, "tokenizer.ggml.tokens").value = tokens
        kv(g, "tokenizer.ggml.scores").value = [0.0] * len(tokens)
        kv(g, "tokenizer.ggml.token_type").value = (
            [3, 3, 3, 2] + [6] * 256 + [1] * (len(tokens) - 260)
        )

    return rebuilt(fn)


gguf_case("token_of_200_KB", _vocab_edit(lambda t: t.__setitem__(261, "b" * 200_000)))
gguf_case("token_with_nul", _vocab_edit(lambda t: t.__setitem__(261, "b\0c")))
gguf_case("token_empty", _vocab_edit(lambda t: t.__setitem__(261, "")))
gguf_case(
    "token_not_utf8",
    rebuilt(lambda g: kv(g, "tokenizer.ggml.tokens").value.__setitem__(261, b"\xff\xfe")),
)
gguf_case("more_tokens_than_embedding_rows", _vocab_edit(lambda t: t.extend(["c", "d"])))


# -- folder cases: safetensors, config.json, generation_config, tokenizers, the index ---------

FolderCase = Callable[[Path], None]
FOLDER_CASES: dict[str, FolderCase] = {}


def folder_case(name: str):
    def register(fn: FolderCase) -> FolderCase:
        FOLDER_CASES[name] = fn
        return fn

    return register


def _config(edit: Callable[[dict], None]) -> FolderCase:
    def fn(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))

    return fn


def _safetensors_header(edit: Callable[[dict], None]) -> FolderCase:
    """Rewrites the JSON header of model.safetensors, keeping its data."""

    def fn(folder: Path) -> None:
        raw = (folder / "model.safetensors").read_bytes()
        (n,) = struct.unpack_from("<Q", raw)
        header = json.loads(raw[8 : 8 + n])
        edit(header)
        text = json.dumps(header).encode()
        (folder / "model.safetensors").write_bytes(
            struct.pack("<Q", len(text)) + text + raw[8 + n :]
        )

    return fn


def _raw_safetensors(make: Callable[[bytes], bytes]) -> FolderCase:
    def fn(folder: Path) -> None:
        path = folder / "model.safetensors"
        path.write_bytes(make(path.read_bytes()))

    return fn


def _write(name: str, data: bytes | str) -> FolderCase:
    def fn(folder: Path) -> None:
        path = folder / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)

    return fn


def _sparse(name: str, size: int) -> FolderCase:
    """A file of ``size`` bytes that takes no disk (a hole), to test size bounds."""

    def fn(folder: Path) -> None:
        with (folder / name).open("wb") as f:
            f.truncate(size)

    return fn


_EMBED = "model.embed_tokens.weight"
_NORM = "model.norm.weight"
for name, fn in [
    ("st_header_len_2^64-1", _raw_safetensors(lambda r: struct.pack("<Q", (1 << 64) - 1) + r[8:])),
    ("st_header_len_100MB+1", _raw_safetensors(lambda r: struct.pack("<Q", 100_000_001) + r[8:])),
    ("st_header_len_past_eof", _raw_safetensors(lambda r: struct.pack("<Q", len(r)) + r[8:])),
    (
        "st_header_not_utf8",
        _raw_safetensors(lambda r: struct.pack("<Q", 4) + b"\xff\xfe{}" + r[8:]),
    ),
    ("st_header_not_json", _raw_safetensors(lambda r: struct.pack("<Q", 4) + b"abcd" + r[8:])),
    ("st_empty_file", _raw_safetensors(lambda r: b"")),
    ("st_seven_bytes", _raw_safetensors(lambda r: r[:7])),
    ("st_truncated_data", _raw_safetensors(lambda r: r[:-100])),
    ("st_trailing_bytes", _raw_safetensors(lambda r: r + b"polyglot")),
    ("st_header_entry_a_list", _safetensors_header(lambda h: h.update({"x": [1]}))),
    (
        "st_overlapping_offsets",
        _safetensors_header(lambda h: h[_NORM].update(data_offsets=h[_EMBED]["data_offsets"])),
    ),
    (
        "st_shape_overflow",
        _safetensors_header(lambda h: h[_EMBED].update(shape=[1 << 62, 1 << 62])),
    ),
    ("st_negative_shape", _safetensors_header(lambda h: h[_NORM].update(shape=[-16]))),
    ("st_unknown_dtype", _safetensors_header(lambda h: h[_NORM].update(dtype="X9"))),
    ("st_complex_weights", _safetensors_header(lambda h: h[_NORM].update(dtype="C64", shape=[8]))),
    ("st_int_weights", _safetensors_header(lambda h: h[_NORM].update(dtype="I32"))),
    ("config_not_json", _write("config.json", "{not json")),
    ("config_not_utf8", _write("config.json", b'{"model_type": "gemma\xff"}')),
    ("config_a_list", _write("config.json", "[1, 2]")),
    ("config_nested_100k_deep", _write("config.json", "[" * 100_000 + "]" * 100_000)),
    ("config_17_MiB", _sparse("config.json", 17 << 20)),
    ("config_layers_10^9", _config(lambda c: c.update(num_hidden_layers=10**9))),
    ("config_head_dim_0", _config(lambda c: c.update(head_dim=0))),
    ("config_vocab_10^12", _config(lambda c: c.update(vocab_size=10**12))),
    ("config_heads_negative", _config(lambda c: c.update(num_attention_heads=-2))),
    ("config_hidden_a_string", _config(lambda c: c.update(hidden_size="16"))),
    ("config_layers_true", _config(lambda c: c.update(num_hidden_layers=True))),
    ("config_layers_float", _config(lambda c: c.update(num_hidden_layers=1.5))),
    ("config_eps_nan", _config(lambda c: c.update(rms_norm_eps=float("nan")))),
    ("config_model_type_a_list", _config(lambda c: c.update(model_type=["gemma"]))),
    (
        "config_text_config_a_list",
        _config(lambda c: c.update(model_type="gemma3", text_config=[1])),
    ),
    (
        "config_implies_10^13_parameters",
        _config(
            lambda c: c.update(vocab_size=1 << 24, hidden_size=1 << 16, num_hidden_layers=1024)
        ),
    ),
    ("config_eos_outside_vocab", _config(lambda c: c.update(eos_token_id=[1, 10**6]))),
    (
        "config_bad_quantization_entry",
        _config(lambda c: c.update(gemma_engine_quantization="int8")),
    ),
    ("config_unsupported_model_type", _config(lambda c: c.update(model_type="llama"))),
    (
        "generation_config_eos_a_dict",
        _write("generation_config.json", '{"eos_token_id": {"a": 1}}'),
    ),
    ("generation_config_not_json", _write("generation_config.json", "eos=1")),
    ("tokenizer_model_garbage", _write("tokenizer.model", os.urandom(4096))),
    ("tokenizer_model_empty", _write("tokenizer.model", b"")),
    ("tokenizer_model_300_MiB", _sparse("tokenizer.model", 300 << 20)),
]:
    folder_case(name)(fn)


@folder_case("tokenizer_model_truncated")
def _tokenizer_truncated(folder: Path) -> None:
    data = (folder / "tokenizer.model").read_bytes()
    (folder / "tokenizer.model").write_bytes(data[: len(data) // 2])


def _tokenizer_proto(edit) -> FolderCase:
    def fn(folder: Path) -> None:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString((folder / "tokenizer.model").read_bytes())
        edit(proto)
        (folder / "tokenizer.model").write_bytes(proto.SerializeToString())

    return fn


folder_case("tokenizer_piece_200_KB")(
    _tokenizer_proto(lambda p: setattr(p.pieces[400], "piece", "q" * 200_000))
)
folder_case("tokenizer_without_bos")(
    _tokenizer_proto(lambda p: setattr(p.trainer_spec, "bos_piece", "<none>"))
)
folder_case("tokenizer_larger_than_model")(_config(lambda c: c.update(vocab_size=300)))


def _tokenizer_json(make: Callable[[Path], None]) -> FolderCase:
    def fn(folder: Path) -> None:
        (folder / "tokenizer.model").unlink()
        make(folder / "tokenizer.json")

    return fn


folder_case("tokenizer_json_garbage")(_tokenizer_json(lambda p: p.write_text('{"model": 5}')))
folder_case("tokenizer_json_300_MiB")(_tokenizer_json(lambda p: p.open("wb").truncate(300 << 20)))


def _index(weight_map) -> FolderCase:
    def fn(folder: Path) -> None:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )

    return fn


folder_case("index_shard_parent_dir")(_index({_EMBED: "../model.safetensors"}))
folder_case("index_shard_absolute")(_index({_EMBED: "/etc/passwd"}))
folder_case("index_shard_not_safetensors")(_index({_EMBED: "config.json"}))
folder_case("index_shard_not_a_string")(_index({_EMBED: 7}))
folder_case("index_weight_map_a_list")(_index(["model.safetensors"]))
folder_case("index_not_json")(_write("model.safetensors.index.json", "{"))


@folder_case("index_shard_links_outside")
def _index_symlink(folder: Path) -> None:
    outside = folder.parent / f"{folder.name}-outside.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    _index({_EMBED: "model.safetensors"})(folder)


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory) -> tuple[GGUF, bytes]:
    g = tiny_gguf()
    return g, g.build()


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory, tokenizer_file) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("base") / "ckpt", tokenizer_file)


def _assert_checkpoint_error(result: dict) -> None:
    assert result["outcome"] == "error", result
    assert result["checkpoint_error"], f"{result['type']} is not a CheckpointError: {result}"
    assert result["message"].strip(), result


def test_the_baselines_load(hostile_server, base_gguf, base_folder, tmp_path) -> None:
    """Every case below is one change away from these, which load and generate."""
    path = tmp_path / "valid.gguf"
    path.write_bytes(base_gguf[1])
    assert hostile_server.load(path)["outcome"] == "ok"
    assert hostile_server.load(base_folder)["outcome"] == "ok"


def test_the_corpus_is_as_large_as_promised() -> None:
    assert len(GGUF_CASES) >= 40 and len(FOLDER_CASES) >= 20


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_malformed_gguf(name, hostile_server, base_gguf, tmp_path) -> None:
    g, data = base_gguf
    spec = tiny_gguf()  # a fresh spec: cases edit it
    spec.build()  # fills spec.fields, the same as g's
    assert spec.fields == g.fields
    path = tmp_path / "bad.gguf"
    path.write_bytes(GGUF_CASES[name](spec, data))
    assert path.read_bytes() != data
    _assert_checkpoint_error(hostile_server.load(path))


@pytest.mark.parametrize("name", sorted(FOLDER_CASES))
def test_malformed_folder(name, hostile_server, base_folder, tmp_path) -> None:
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(base_folder, folder)
    FOLDER_CASES[name](folder)
    _assert_checkpoint_error(hostile_server.load(folder))


@pytest.mark.parametrize(
    "name",
    [
        "issue_array_of_2^63",
        "kv:tokenizer.ggml.tokens.len=2^63",
        "five_dimensions",
        "token_of_200_KB",
    ],
)
def test_gemma_run_prints_one_line(name, base_gguf, tmp_path) -> None:
    """The real command (a fresh process, ~3 s each): exit 2, one stderr line, no traceback."""
    spec = tiny_gguf()
    spec.build()
    path = tmp_path / "bad.gguf"
    path.write_bytes(GGUF_CASES[name](spec, base_gguf[1]))
    proc = gemma_run(["--model", str(path), "--prompt", "hi", "--no-compile"], timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("gemma-run: error: "), err
    assert proc.stdout == b""


def test_gemma_run_on_a_bad_folder(base_folder, tmp_path) -> None:
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(base_folder, folder)
    FOLDER_CASES["st_header_len_2^64-1"](folder)
    proc = gemma_run(["--model", str(folder), "--prompt", "hi", "--no-compile"], timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and "safetensors" in err, err


def test_check_agrees_with_the_gguf_reader(base_gguf, tmp_path) -> None:
    """The walk finds the data where gguf's own reader does (an independent parser)."""
    import gguf

    from gemma_engine.gguf_check import check_gguf

    path = tmp_path / "valid.gguf"
    path.write_bytes(base_gguf[1])
    layout = check_gguf(path)
    reader = gguf.GGUFReader(path)
    assert layout.data_start == reader.data_offset
    assert layout.data_end == max(t.data_offset + t.n_bytes for t in reader.tensors)
    assert (layout.n_tensors, layout.n_kv) == (len(reader.tensors), len(base_gguf[0].kvs))


@pytest.mark.parametrize(
    "key", ["bos_token_id", "eos_token_id", "max_position_embeddings", "rms_norm_eps"]
)
def test_null_config_values_mean_the_default(key, hostile_server, base_folder, tmp_path) -> None:
    """Found by test_fuzz.py: a null used to reach int(None); null now means "not set"."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(base_folder, folder)
    _config(lambda c: c.update({key: None}))(folder)
    assert hostile_server.load(folder)["outcome"] == "ok"
