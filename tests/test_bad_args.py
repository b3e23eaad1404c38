"""A table of gemma-run invocations with bad arguments: each exits 2 with one line on stderr.

The table runs ``gemma_engine.cli.main`` in forked children of the fork server (tests/hostile.py,
tens of milliseconds each); the three invocations of the issue, and a prompt with invalid
bytes in argv, also run through the real command in a fresh process.
"""

from __future__ import annotations

import os

import pytest
import torch
from hostile import gemma_run, tiny_folder

MODEL = "<tiny>"  # replaced by the tiny checkpoint's folder
NO_CUDA = not torch.cuda.is_available()
# One CUDA device more than this machine has: an error on every machine.
MISSING_CUDA = f"cuda:{torch.cuda.device_count()}"

# (name, argv, stdin, a word the message must contain)
TABLE = [
    ("stdin_not_utf8", ["--prompt", "-"], b"\xff\xfe bad", "not UTF-8"),
    ("device_tpu", ["--prompt", "hi", "--device", "tpu"], b"", "tpu"),
    ("device_malformed", ["--prompt", "hi", "--device", "cuda:x"], b"", "cuda:x"),
    ("device_mps", ["--prompt", "hi", "--device", "mps"], b"", "mps"),
    ("device_meta", ["--prompt", "hi", "--device", "meta"], b"", "meta"),
    ("device_missing_gpu", ["--prompt", "hi", "--device", MISSING_CUDA], b"", MISSING_CUDA),
    ("dtype_int8", ["--prompt", "hi", "--dtype", "int8"], b"", "dtype"),
    ("dtype_float64", ["--prompt", "hi", "--dtype", "float64"], b"", "dtype"),
    ("kv_cache_dtype_int8", ["--prompt", "hi", "--kv-cache-dtype", "int8"], b"", "kv_cache_dtype"),
    ("prompt_file_folder", ["--prompt-file", "<dir>"], b"", "folder"),
    ("prompt_file_missing", ["--prompt-file", "<dir>/nope.txt"], b"", "cannot read"),
    ("prompt_file_binary", ["--prompt-file", "<binary>"], b"", "not UTF-8"),
    ("prompt_file_nul", ["--prompt-file", "<nul>"], b"", "NUL"),
    ("prompt_file_endless", ["--prompt-file", "/dev/zero"], b"", "bytes"),
    ("two_prompts", ["--prompt", "hi", "--prompt-file", "<nul>"], b"", "not allowed"),
    ("no_prompt", ["--max-new-tokens", "3"], b"", "required"),
    ("system_without_chat", ["--prompt", "hi", "--system", "be brief"], b"", "--chat"),
    ("precompile_eagerly", ["--precompile", "--no-compile"], b"", "--no-compile"),
    ("precompile_and_prompt", ["--precompile", "--prompt", "hi"], b"", "not allowed"),
    ("max_new_tokens_word", ["--prompt", "hi", "--max-new-tokens", "many"], b"", "many"),
    ("quantize_int3", ["--prompt", "hi", "--quantize", "int3"], b"", "int3"),
    ("buckets_words", ["--prompt", "hi", "--buckets", "a,b"], b"", "buckets"),
    ("model_missing", ["--prompt", "hi", "--model", "<dir>/nope"], b"", "not found"),
    ("model_pickle", ["--prompt", "hi", "--model", "<pickle>"], b"", "pickle"),
    ("model_not_a_checkpoint", ["--prompt", "hi", "--model", "/dev/null"], b"", "config.json"),
    ("max_new_tokens_0", ["--prompt", "hi", "--max-new-tokens", "0"], b"", "max_new_tokens"),
    ("temperature_nan", ["--prompt", "hi", "--temperature", "nan"], b"", "temperature"),
    ("temperature_negative", ["--prompt", "hi", "--temperature", "-1"], b"", "temperature"),
    ("temperature_tiny", ["--prompt", "hi", "--temperature", "1e-30"], b"", "temperature"),
    ("temperature_inf", ["--prompt", "hi", "--temperature", "inf"], b"", "temperature"),
    ("top_p_0", ["--prompt", "hi", "--top-p", "0"], b"", "top_p"),
    ("top_k_0", ["--prompt", "hi", "--top-k", "0"], b"", "top_k"),
    ("seed_negative", ["--prompt", "hi", "--seed", "-1"], b"", "seed"),
    ("seed_2^70", ["--prompt", "hi", "--seed", str(1 << 70)], b"", "seed"),
    ("max_seq_len_0", ["--prompt", "hi", "--max-seq-len", "0"], b"", "max_seq_len"),
    ("max_seq_len_too_long", ["--prompt", "hi", "--max-seq-len", "100000"], b"", "max_seq_len"),
    ("buckets_0", ["--prompt", "hi", "--buckets", "0"], b"", "buckets"),
    ("group_size_7", ["--prompt", "hi", "--quantize", "int4", "--group-size", "7"], b"", "group"),
    ("stop_empty", ["--prompt", "hi", "--stop", ""], b"", "stop"),
    ("prompt_lone_surrogate", ["--prompt", "a\udcffb"], b"", "surrogate"),
    ("prompt_too_long", ["--prompt", "word " * 100, "--max-seq-len", "16"], b"", "max_seq_len"),
]
if NO_CUDA:
    TABLE.append(("device_cuda_without_cuda", ["--prompt", "hi", "--device", "cuda"], b"", "CUDA"))
# Cases that need no model get the default model's path (they fail before it is read); the
# rest run on the tiny checkpoint.
NEEDS_NO_MODEL = {"stdin_not_utf8", "no_prompt", "two_prompts", "system_without_chat"}
NEEDS_NO_MODEL |= {
    name for name, *_ in TABLE if name.startswith(("device_", "dtype_", "prompt_file"))
}
NEEDS_NO_MODEL |= {"max_new_tokens_word", "quantize_int3", "buckets_words"}
NEEDS_NO_MODEL |= {name for name, *_ in TABLE if name.startswith("model_")}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_file) -> dict[str, str]:
    root = tmp_path_factory.mktemp("badargs")
    (root / "binary.bin").write_bytes(os.urandom(1000) + b"\xff\xfe")
    (root / "nul.txt").write_bytes(b"some text\0more")
    (root / "weights.pt").write_bytes(b"\x80\x04not really a pickle")
    return {
        "<dir>": str(root),
        "<binary>": str(root / "binary.bin"),
        "<nul>": str(root / "nul.txt"),
        "<pickle>": str(root / "weights.pt"),
        MODEL: str(tiny_folder(root / "tiny", tokenizer_file)),
    }


def _argv(name: str, argv: list[str], files: dict[str, str]) -> list[str]:
    out = []
    for arg in argv:
        for key, value in files.items():
            arg = arg.replace(key, value)
        out.append(arg)
    if name not in NEEDS_NO_MODEL:
        out += ["--model", files[MODEL], "--no-compile"]
    return out


def _assert_one_line(code, stderr: str, word: str) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("gemma-run: error: "), stderr
    assert word in stderr, stderr


@pytest.mark.parametrize("name, argv, stdin, word", TABLE, ids=[row[0] for row in TABLE])
def test_bad_arguments(name, argv, stdin, word, hostile_server, files) -> None:
    result = hostile_server.cli(_argv(name, argv, files), stdin)
    assert result["outcome"] == "exit", result
    _assert_one_line(result["code"], result["stderr"], word)
    assert result["stdout"] in ("", "\n"), result  # nothing generated


def test_the_table_is_complete() -> None:
    assert len(TABLE) >= 30 and len({row[0] for row in TABLE}) == len(TABLE)


@pytest.mark.parametrize(
    "argv, stdin, word",
    [
        (["--prompt", "-"], b"\xff\xfe bad", "not UTF-8"),  # printf '\xff\xfe bad' | gemma-run ...
        (["--prompt", "hi", "--device", "cuda" if NO_CUDA else MISSING_CUDA], b"", "cuda"),
        (["--prompt", "hi", "--device", "tpu"], b"", "tpu"),
        ([b"--prompt", b"caf\xe9"], b"", "surrogate"),  # Latin-1 bytes in argv
    ],
    ids=["stdin_not_utf8", "device_cuda", "device_tpu", "argv_not_utf8"],
)
def test_the_real_command(argv, stdin, word, files) -> None:
    """A fresh gemma-run process (~3 s each): the issue's invocations, one line and exit 2."""
    if isinstance(argv[0], bytes):
        argv = [*argv, b"--model", files[MODEL].encode(), b"--no-compile"]
    proc = gemma_run(argv, stdin, timeout=60)
    _assert_one_line(proc.returncode, proc.stderr.decode(errors="replace"), word)


# -- the same edges in the Python API --------------------------------------------------------


@pytest.fixture(scope="module")
def engine(files):
    from gemma_engine import Engine

    return Engine.from_pretrained(files[MODEL], device="cpu", compile=False, max_seq_len=32)


@pytest.mark.parametrize(
    "device", ["tpu", "cuda:x", "mps", "meta", MISSING_CUDA, 0] + (["cuda"] * NO_CUDA)
)
def test_api_refuses_devices(device, files) -> None:
    from gemma_engine import Engine, InvalidRequestError

    with pytest.raises(InvalidRequestError, match="device"):
        Engine.from_pretrained(files[MODEL], device=device, compile=False)


@pytest.mark.parametrize("dtype", ["int8", torch.int8, torch.float64, 32, ["float32"]])
def test_api_refuses_dtypes(dtype, files) -> None:
    from gemma_engine import Engine, InvalidRequestError

    with pytest.raises(InvalidRequestError, match="dtype"):
        Engine.from_pretrained(files[MODEL], device="cpu", dtype=dtype, compile=False)


@pytest.mark.parametrize(
    "prompt, word",
    [
        ([2, True, 5], "bool"),
        ([2, 5.0], "whole number"),
        ([2, "5"], "whole number"),
        ([2, -1], "vocabulary"),
        ([2, 512], "vocabulary"),
        ("a\ud800b", "surrogate"),
        ((2, 5), "prompt must be"),
    ],
)
def test_api_refuses_prompts(engine, prompt, word) -> None:
    from gemma_engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=word):
        engine.generate(prompt, max_new_tokens=1)


def test_api_takes_numpy_and_tensor_ids_as_ints(engine) -> None:
    """Integer types that convert losslessly (__index__) are token ids; the result is the same."""
    import numpy as np

    plain = engine.generate([2, 5, 9], max_new_tokens=3).token_ids
    assert (
        engine.generate([np.int64(2), np.int32(5), torch.tensor(9)], max_new_tokens=3).token_ids
        == plain
    )


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(temperature=True), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=1e-30), "temperature"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed=1 << 64), "seed"),
        (dict(seed=1.0), "seed"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(max_new_tokens=2.0), "max_new_tokens"),
        (dict(stop="a\udcff"), "surrogate"),
        (dict(stop=5), "stop"),
    ],
)
def test_api_refuses_generation_args(engine, kwargs, word) -> None:
    from gemma_engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=word):
        engine.generate("hi", **{"max_new_tokens": 1, **kwargs})
