"""Helpers for the hostile-input tests: a GGUF writer that can lie, tiny valid checkpoints, and a
fork server that runs each case in a fresh, memory-limited process.

Why a fork server: each case must run in its own process (a hang, a crash or a runaway
allocation must fail that case, not the suite), under an address-space limit. A fresh Python
pays 2-3 s importing torch; this server imports torch and gemma_engine once, then forks a
child per case, applies ``RLIMIT_AS`` in the child, and kills it past its timeout. A case
then costs tens of milliseconds. Run ``python tests/hostile.py serve`` to start one by hand;
:class:`Server` speaks its protocol (one JSON object per line, both ways).
"""

from __future__ import annotations

import base64
import io
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ADDRESS_SPACE_LIMIT = 2 << 30  # bytes: RLIMIT_AS of every case
CASE_TIMEOUT = 5.0  # seconds a case may take (a tiny model loads in ~0.1 s)

# -- GGUF files, valid or not ---------------------------------------------------------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f"}
_PACK |= {BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
GGML_F32, GGML_Q8_0 = 0, 8


@dataclass
class KV:
    key: str
    type: int
    value: Any
    item: int | None = None  # element type of an array


@dataclass
class Tensor:
    name: str
    dims: list[int]  # GGUF order: fastest-varying first
    type: int
    data: bytes
    offset: int | None = None  # None: the next aligned offset


@dataclass
class GGUF:
    """A GGUF file as a list of parts; ``build`` writes it and records where each field is."""

    kvs: list[KV]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32
    n_tensors: int | None = None  # None: the real counts
    n_kv: int | None = None
    fields: dict[str, int] = field(default_factory=dict)  # field name -> byte offset

    def build(self) -> bytes:
        out = bytearray()

        def mark(name: str) -> None:
            self.fields[name] = len(out)

        def put(fmt: str, value: Any) -> None:
            out.extend(struct.pack(fmt, value))

        def put_str(text: str | bytes, name: str) -> None:
            data = text.encode() if isinstance(text, str) else text
            mark(name)
            put("<Q", len(data))
            out.extend(data)

        def put_value(kind: int, value: Any, item: int | None, name: str) -> None:
            if kind == STR:
                put_str(value, name + ".len")
            elif kind == ARR:
                mark(name + ".item")
                put("<I", item)
                mark(name + ".len")
                put("<Q", len(value))
                for i, v in enumerate(value):
                    put_value(item, v, None, f"{name}[{i}]")
            else:
                mark(name + ".value")
                put(_PACK[kind], value)

        out += b"GGUF"
        mark("version")
        put("<I", self.version)
        mark("n_tensors")
        put("<Q", len(self.tensors) if self.n_tensors is None else self.n_tensors)
        mark("n_kv")
        put("<Q", len(self.kvs) if self.n_kv is None else self.n_kv)
        for kv in self.kvs:
            put_str(kv.key, f"kv:{kv.key}.keylen")
            mark(f"kv:{kv.key}.type")
            put("<I", kv.type)
            put_value(kv.type, kv.value, kv.item, f"kv:{kv.key}")
        mark("tensor_infos")
        offset = 0
        offsets = []
        for t in self.tensors:
            put_str(t.name, f"t:{t.name}.namelen")
            mark(f"t:{t.name}.ndims")
            put("<I", len(t.dims))
            for d, n in enumerate(t.dims):
                mark(f"t:{t.name}.dim{d}")
                put("<Q", n)
            mark(f"t:{t.name}.type")
            put("<I", t.type)
            mark(f"t:{t.name}.offset")
            at = offset if t.offset is None else t.offset
            put("<Q", at)
            offsets.append(at)
            offset = _pad(at + len(t.data), self.alignment)
        out += bytes(_pad(len(out), self.alignment) - len(out))
        mark("data")
        start = len(out)
        for t, at in zip(self.tensors, offsets, strict=True):
            if start + at > len(out):
                out += bytes(start + at - len(out))
            out[start + at : start + at + len(t.data)] = t.data
            mark(f"t:{t.name}.data")
        mark("end")
        return bytes(out)


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


# A tiny Gemma 1 layout: 1 layer, hidden 32, 2 heads of 16, 1 KV head, MLP 64, 262 tokens.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 1, 16, 64, 1
VOCAB = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{i:02X}>" for i in range(256)), "\u2581a", "b"]


def tiny_gguf(seed: int = 0) -> GGUF:
    """A valid Gemma 1 GGUF that loads and generates; one tensor is Q8_0."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    arch = "gemma"
    kvs = [
        KV("general.architecture", STR, arch),
        KV("general.alignment", U32, 32),
        KV(f"{arch}.context_length", U32, 64),
        KV(f"{arch}.embedding_length", U32, HIDDEN),
        KV(f"{arch}.block_count", U32, LAYERS),
        KV(f"{arch}.feed_forward_length", U32, FFN),
        KV(f"{arch}.attention.head_count", U32, HEADS),
        KV(f"{arch}.attention.head_count_kv", U32, KV_HEADS),
        KV(f"{arch}.attention.key_length", U32, HEAD_DIM),
        KV(f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-6),
        KV("tokenizer.ggml.model", STR, "llama"),
        KV("tokenizer.ggml.tokens", ARR, list(VOCAB), STR),
        KV("tokenizer.ggml.scores", ARR, [0.0] * len(VOCAB), F32),
        KV("tokenizer.ggml.token_type", ARR, [3, 3, 3, 2] + [6] * 256 + [1, 1], I32),
        KV("tokenizer.ggml.bos_token_id", U32, 2),
        KV("tokenizer.ggml.eos_token_id", U32, 1),
    ]
    shapes = {
        "token_embd.weight": [HIDDEN, len(VOCAB)],
        "output_norm.weight": [HIDDEN],
        "blk.0.attn_norm.weight": [HIDDEN],
        "blk.0.attn_q.weight": [HIDDEN, HEADS * HEAD_DIM],
        "blk.0.attn_k.weight": [HIDDEN, KV_HEADS * HEAD_DIM],
        "blk.0.attn_v.weight": [HIDDEN, KV_HEADS * HEAD_DIM],
        "blk.0.attn_output.weight": [HEADS * HEAD_DIM, HIDDEN],
        "blk.0.ffn_norm.weight": [HIDDEN],
        "blk.0.ffn_gate.weight": [HIDDEN, FFN],
        "blk.0.ffn_up.weight": [HIDDEN, FFN],
        "blk.0.ffn_down.weight": [FFN, HIDDEN],
    }
    tensors = []
    for name, dims in shapes.items():
        array = rng.standard_normal(tuple(reversed(dims))).astype(np.float32) * 0.2
        if name == "blk.0.ffn_gate.weight":
            data = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0).tobytes()
            tensors.append(Tensor(name, dims, GGML_Q8_0, data))
        else:
            tensors.append(Tensor(name, dims, GGML_F32, array.tobytes()))
    return GGUF(kvs, tensors)


def kv(g: GGUF, key: str) -> KV:
    return next(k for k in g.kvs if k.key == key)


def tensor(g: GGUF, name: str) -> Tensor:
    return next(t for t in g.tensors if t.name == name)


def patch(data: bytes, offset: int, fmt: str, value: Any) -> bytes:
    """``data`` with ``value`` packed at ``offset``."""
    raw = struct.pack(fmt, value)
    return data[:offset] + raw + data[offset + len(raw) :]


# -- tiny safetensors checkpoints -----------------------------------------------------------


def tiny_folder(folder: Path, tokenizer_file: Path) -> Path:
    """A valid, tiny Gemma 1 checkpoint folder (config.json, safetensors, tokenizer.model)
    written without transformers: the weights are random, only loading is under test."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "gemma",
        "vocab_size": 512,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    (folder / "tokenizer.model").write_bytes(tokenizer_file.read_bytes())
    g = torch.Generator().manual_seed(0)
    h, f, q, k = 16, 32, 2 * 8, 8
    shapes = {
        "model.embed_tokens.weight": (512, h),
        "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (q, h),
        "model.layers.0.self_attn.k_proj.weight": (k, h),
        "model.layers.0.self_attn.v_proj.weight": (k, h),
        "model.layers.0.self_attn.o_proj.weight": (h, q),
        "model.layers.0.mlp.gate_proj.weight": (f, h),
        "model.layers.0.mlp.up_proj.weight": (f, h),
        "model.layers.0.mlp.down_proj.weight": (h, f),
    }
    tensors = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# -- the fork server -------------------------------------------------------------------------


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def _describe(err: BaseException) -> dict[str, Any]:
    from gemma_engine import CheckpointError, GemmaEngineError

    return {
        "outcome": "error",
        "type": type(err).__name__,
        "checkpoint_error": isinstance(err, CheckpointError),
        "engine_error": isinstance(err, GemmaEngineError),
        "message": str(err),
    }


def _load(path: str) -> dict[str, Any]:
    """The user's path: load the checkpoint; if that works, generate two tokens."""
    from gemma_engine import Engine

    try:
        engine = Engine.from_pretrained(path, device="cpu", compile=False, max_seq_len=32)
        engine.generate([engine.tokenizer.bos_id], max_new_tokens=2)
    except Exception as err:  # anything not a CheckpointError fails the case
        return _describe(err)
    return {"outcome": "ok"}


def _cli(argv: list[str], stdin: bytes) -> dict[str, Any]:
    """gemma_engine.cli.main(argv) with this stdin; its exit code and what it printed."""
    from gemma_engine import cli

    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8", errors="surrogateescape")
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    try:
        code = cli.main(argv)
    except SystemExit as done:  # argparse
        code = done.code
    except BaseException as err:  # a traceback in the real command
        import traceback

        traceback.print_exc(file=sys.stderr)
        code = f"raised {type(err).__name__}"
    return {
        "outcome": "exit",
        "code": code,
        "stdout": sys.stdout.getvalue(),
        "stderr": sys.stderr.getvalue(),
    }


def _run_case(request: dict[str, Any]) -> dict[str, Any]:
    if request["action"] == "load":
        return _load(request["path"])
    if request["action"] == "cli":
        return _cli(request["argv"], base64.b64decode(request.get("stdin", "")))
    raise ValueError(f"unknown action {request['action']!r}")


def _fork_case(request: dict[str, Any]) -> dict[str, Any]:
    """Runs one case in a forked child under RLIMIT_AS; kills it past its timeout."""
    read_end, write_end = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: limit, run, report, and leave without cleanup
        os.close(read_end)
        try:
            _limit_memory()
            result = _run_case(request)
        except BaseException as err:  # noqa: BLE001 - reported, not raised
            result = {"outcome": "harness", "message": f"{type(err).__name__}: {err}"}
        with os.fdopen(write_end, "wb") as out:
            out.write(json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    timeout = request.get("timeout", CASE_TIMEOUT)
    chunks = []
    deadline = start + timeout
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"outcome": "timeout", "seconds": time.monotonic() - start}
            chunk = os.read(pipe.fileno(), 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - start
    if os.WIFSIGNALED(status):
        return {"outcome": "crash", "signal": os.WTERMSIG(status), "seconds": seconds}
    if not chunks:
        return {"outcome": "crash", "status": status, "seconds": seconds}
    return {**json.loads(b"".join(chunks)), "seconds": seconds}


def _warm_up() -> None:
    """Loads a valid GGUF and its converted folder once, here, so that the first-use costs of
    torch and the loaders (about 1.5 s) are paid before forking rather than in every child."""
    import tempfile

    from gemma_engine.gguf import convert_gguf

    with tempfile.TemporaryDirectory(prefix="hostile-warm-") as tmp:
        path = Path(tmp) / "tiny.gguf"
        path.write_bytes(tiny_gguf().build())
        convert_gguf(path, Path(tmp) / "folder")
        for source in (path, Path(tmp) / "folder"):
            result = _load(str(source))
            if result["outcome"] != "ok":
                raise RuntimeError(f"the valid tiny checkpoint does not load: {result}")


def serve() -> None:
    """The server loop: one request per stdin line, one reply per stdout line."""
    import torch

    torch.set_num_threads(1)  # before any parallel region: no OpenMP pool to break by forking
    import gguf  # noqa: F401
    import safetensors.torch  # noqa: F401
    import sentencepiece  # noqa: F401

    import gemma_engine.cli  # noqa: F401
    import gemma_engine.engine  # noqa: F401
    import gemma_engine.gguf  # noqa: F401

    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    _warm_up()
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        reply = _fork_case(json.loads(line))
        out.write(json.dumps(reply) + "\n")
        out.flush()


class Server:
    """The client side: ``run(action=..., ...)`` -> the case's result dict."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        ready = self.proc.stdout.readline()
        if not ready.startswith('{"ready"'):
            raise RuntimeError(f"the hostile-input server did not start: {ready!r}")

    def run(self, **request: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError("the hostile-input server died")
        return json.loads(reply)

    def load(self, path: str | Path, timeout: float = CASE_TIMEOUT) -> dict[str, Any]:
        return self.run(action="load", path=str(path), timeout=timeout)

    def cli(self, argv: list[str], stdin: bytes = b"") -> dict[str, Any]:
        return self.run(action="cli", argv=argv, stdin=base64.b64encode(stdin).decode())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def gemma_run(
    args: list[str], stdin: bytes = b"", timeout: float = 120
) -> subprocess.CompletedProcess:
    """The installed gemma-run command, under the same address-space limit."""
    exe = Path(sys.executable).with_name("gemma-run")
    return subprocess.run(
        [str(exe), *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        preexec_fn=_limit_memory,
    )


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
