"""Property-based fuzzing of the loaders: a mutated checkpoint loads (and generates) or raises a
CheckpointError, in a fresh child under the 2 GiB / 5 s limits of tests/hostile.py.

Mutations favour the parts parsers trip over: the GGUF header (counts, lengths, types and
offsets overwritten with boundary values at the byte offsets where the fields are), the
safetensors header (its JSON, and its raw bytes), and config.json values replaced by arbitrary
JSON. Each test stops generating after its time budget (about 25 s: these run ~10-20 examples
per second), so the file costs about a minute; hypothesis prints a failing example in full.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
from hostile import tiny_folder, tiny_gguf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

BUDGET_SECONDS = 25.0
FUZZ = settings(
    max_examples=1000,  # the time budget ends a test first on this machine
    deadline=None,  # a case's own timeout (5 s) is enforced by the fork server
    database=None,  # nothing written into the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Boundary values for counts, lengths and offsets.
BOUNDARIES = [0, 1, 2, 3, 4, 5, 8, 31, 32, 33, 63, 64, 255, 256, 1 << 16, 1 << 31, 1 << 32]
BOUNDARIES += [
    (1 << 32) - 1,
    1 << 40,
    (1 << 42) + 1,
    1 << 62,
    1 << 63,
    (1 << 63) - 1,
    (1 << 64) - 1,
]


def _u64s() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(BOUNDARIES), st.integers(0, (1 << 64) - 1))


class Budget:
    """Examples after the budget return at once (hypothesis has no wall-clock bound)."""

    def __init__(self) -> None:
        self.end = time.monotonic() + BUDGET_SECONDS
        self.examples = 0

    def spent(self) -> bool:
        if time.monotonic() > self.end:
            return True
        self.examples += 1
        return False


def _check(result: dict) -> None:
    assert result["outcome"] in ("ok", "error"), result  # not a timeout, crash or harness fault
    if result["outcome"] == "error":
        # A context length mutated below the 32 positions the harness asks for makes the
        # request wrong, not the file: the engine's own error for the request says so.
        too_long = result["type"] == "InvalidRequestError" and (
            "max_position_embeddings" in result["message"]
        )
        assert result["checkpoint_error"] or too_long, result


# -- GGUF ------------------------------------------------------------------------------------

_SPEC = tiny_gguf()
_GGUF = _SPEC.build()
_HEADER_END = _SPEC.fields["data"]
_HEADER_FIELDS = sorted(v for v in _SPEC.fields.values() if v < _HEADER_END)

gguf_edit = st.one_of(
    st.tuples(st.just("u64"), st.sampled_from(_HEADER_FIELDS), _u64s()),
    st.tuples(st.just("u32"), st.sampled_from(_HEADER_FIELDS), st.integers(0, (1 << 32) - 1)),
    st.tuples(st.just("byte"), st.integers(0, _HEADER_END - 1), st.integers(0, 255)),
    st.tuples(st.just("byte"), st.integers(0, len(_GGUF) - 1), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(_GGUF) - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, _HEADER_END), st.integers(1, 16)),
    st.tuples(st.just("delete"), st.integers(0, _HEADER_END), st.integers(1, 16)),
)


def _mutate(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, at, value in edits:
        at = min(at, len(out))
        if kind == "u64":
            out[at : at + 8] = struct.pack("<Q", value)
        elif kind == "u32":
            out[at : at + 4] = struct.pack("<I", value)
        elif kind == "byte" and at < len(out):
            out[at] = value
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = bytes(value)
        elif kind == "delete":
            del out[at : at + value]
    return bytes(out)


@pytest.fixture(scope="module")
def gguf_budget() -> Budget:
    return Budget()


@FUZZ
@given(edits=st.lists(gguf_edit, min_size=1, max_size=6))
@example(edits=[("u32", _SPEC.fields["kv:gemma.context_length.value"], 1)])  # found by CI
def test_fuzz_gguf(edits, hostile_server, tmp_path_factory, gguf_budget) -> None:
    if gguf_budget.spent():
        return
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    path.write_bytes(_mutate(_GGUF, edits))
    _check(hostile_server.load(path))


# -- safetensors and config.json --------------------------------------------------------------

DTYPES = ["F64", "F32", "F16", "BF16", "F8_E4M3", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64"]
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(BOUNDARIES + [-1, -(1 << 63), 10**12]),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
tensor_edit = st.one_of(
    st.tuples(st.just("dtype"), st.sampled_from(DTYPES)),
    st.tuples(st.just("shape"), st.lists(st.sampled_from(BOUNDARIES), max_size=5)),
    st.tuples(
        st.just("offsets"),
        st.lists(st.sampled_from(BOUNDARIES + [40, 1024]), min_size=2, max_size=2),
    ),
    st.tuples(st.just("drop"), st.none()),
)
folder_edit = st.one_of(
    st.tuples(st.just("tensor"), st.integers(0, 10), tensor_edit),
    st.tuples(st.just("header_byte"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(
        st.just("config"),
        st.sampled_from(
            sorted(
                json.loads(
                    '["model_type","vocab_size","hidden_size","intermediate_size","num_hidden_layers",'
                    '"num_attention_heads","num_key_value_heads","head_dim","max_position_embeddings",'
                    '"rms_norm_eps","bos_token_id","eos_token_id","pad_token_id","sliding_window",'
                    '"layer_types","rope_scaling","rope_theta","tie_word_embeddings",'
                    '"final_logit_softcapping","query_pre_attn_scalar","gemma_engine_quantization"]'
                )
            )
        ),
        json_values,
    ),
)


def _edit_folder(folder: Path, edits) -> None:
    config = json.loads((folder / "config.json").read_text())
    raw = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header, data = json.loads(raw[8 : 8 + n]), bytearray(raw[8 + n :])
    names = sorted(k for k in header if k != "__metadata__")
    byte_edits = []
    for edit in edits:
        if edit[0] == "tensor":
            name = names[edit[1] % len(names)]
            kind, value = edit[2]
            if kind == "drop":
                header.pop(name, None)
            elif name in header:
                header[name][{"offsets": "data_offsets"}.get(kind, kind)] = value
        elif edit[0] == "header_byte":
            byte_edits.append(edit[1:])
        else:
            config[edit[1]] = edit[2]
    text = json.dumps(header).encode()
    out = bytearray(struct.pack("<Q", len(text)) + text + data)
    for at, value in byte_edits:
        out[at % (8 + len(text))] = value
    (folder / "model.safetensors").write_bytes(bytes(out))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def fuzz_folder(tmp_path_factory, tokenizer_file) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("fuzzbase") / "ckpt", tokenizer_file)


@pytest.fixture(scope="module")
def folder_budget() -> Budget:
    return Budget()


@FUZZ
@given(edits=st.lists(folder_edit, min_size=1, max_size=4))
def test_fuzz_safetensors_and_config(edits, hostile_server, fuzz_folder, folder_budget) -> None:
    if folder_budget.spent():
        return
    folder = fuzz_folder.with_name("fuzzed")
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(fuzz_folder, folder)
    _edit_folder(folder, edits)
    _check(hostile_server.load(folder))


def test_the_fuzz_ran(gguf_budget, folder_budget) -> None:
    """The budgets are spent on real examples, not skipped (runs after the two above)."""
    print(f"fuzzed {gguf_budget.examples} GGUF and {folder_budget.examples} folder examples")
    assert gguf_budget.examples >= 50 and folder_budget.examples >= 50, (
        gguf_budget.examples,
        folder_budget.examples,
    )
