"""The compile cache (compile_cache.py), through gemma-run in fresh processes.

A process that builds a decode graph leaves it in the cache, saved whole as an AOTInductor
package (saved_graphs.py); the next process loads it there (and says so) instead of compiling; a
cache made for another torch or CPU, an unreadable package or a broken library inside one, is
cleared with one warning line and built again. In every case the text equals the eager
engine's (itself checked against transformers in test_parity.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gemma_engine import compile_cache, packed_int8, saved_graphs

PROMPT = "The quick brown fox"
OPTIONS = ["--max-new-tokens", "8", "--buckets", "16", "--max-seq-len", "16", "--max-batch", "1"]
READY = "the decode graph for 1 row and kv bucket 16 is ready"


def gemma_run(model: Path, cache: Path, *args: str, env: dict | None = None):
    environ = {**os.environ, "GEMMA_ENGINE_CACHE": str(cache), **(env or {})}
    environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    run = subprocess.run(
        [sys.executable, "-m", "gemma_engine.cli", "--model", str(model), *OPTIONS, *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return run


def source_of_graph(stderr: str, ready: str = READY) -> str:
    """Where the graph came from, from its one ready notice: 'compiled', 'from the compile
    cache' (loaded whole) or 'traced, its code from the compile cache'."""
    lines = [line for line in stderr.splitlines() if ready in line]
    assert len(lines) == 1, stderr
    return lines[0].split(" s, ", 1)[1].rstrip(")")


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "warning:" in line]


def cache_folder(cache: Path) -> Path:
    (folder,) = (cache / "inductor").iterdir()
    return folder


@pytest.fixture(scope="module")
def model(tiny_checkpoints) -> Path:
    return tiny_checkpoints["gemma3"][0]


@pytest.fixture(scope="module")
def eager_text(model, tmp_path_factory) -> str:
    return gemma_run(model, tmp_path_factory.mktemp("unused"), "--prompt", PROMPT, "--no-compile")


@pytest.fixture(scope="module")
def warm_cache(model, tmp_path_factory) -> Path:
    """A cache that --precompile filled."""
    cache = tmp_path_factory.mktemp("cache")
    run = gemma_run(model, cache, "--precompile")
    assert "compiling the decode graph for 1 row and kv bucket 16" in run.stderr
    assert source_of_graph(run.stderr) == "compiled"
    assert "decode graphs ready for 1 sequence and kv buckets 16" in run.stderr
    assert run.stdout == "" and not warnings(run.stderr)
    return cache


def test_the_next_process_finds_the_graph_precompile_built(model, warm_cache, eager_text, tmp_path):
    """The next process loads the graph, with the eager output, and leaves nothing in the
    temporary directory: the package loader's unzipped copy, which gemma-run's quick exit never
    let it remove, goes as soon as the graph is loaded."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    (saved,) = (cache_folder(warm_cache) / saved_graphs.FOLDER).glob("forward-*.pt2")
    os.utime(saved, (0, 0))
    run = gemma_run(model, warm_cache, "--prompt", PROMPT, env={"TMPDIR": str(temp)})
    assert [p.name for p in temp.iterdir()] == []
    assert saved.stat().st_mtime > time.time() - 600  # used: compile_cache.trim keeps it
    assert source_of_graph(run.stderr) == "from the compile cache"
    assert "compiling" not in run.stderr  # the notice comes only when a graph is built
    assert run.stdout == eager_text.stdout and not warnings(run.stderr)
    stamp = json.loads((cache_folder(warm_cache) / compile_cache.STAMP).read_text())
    assert stamp["torch"] and stamp["capability"] and stamp["cpu"]


def test_each_graph_is_saved_whole_and_built_again_without_its_file(
    model, warm_cache, eager_text, tmp_path
):
    """--precompile saved the graph whole (saved_graphs.py); without that file, the next
    process builds the graph again and saves it, and the one after loads it."""
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    graphs = cache_folder(cache) / saved_graphs.FOLDER
    (saved,) = graphs.glob(f"forward-*{saved_graphs.SUFFIX}")
    saved.unlink()
    run = gemma_run(model, cache, "--prompt", PROMPT)
    assert source_of_graph(run.stderr) != "from the compile cache"
    assert saved.exists() and not warnings(run.stderr)
    assert run.stdout == eager_text.stdout
    again = gemma_run(model, cache, "--prompt", PROMPT)
    assert source_of_graph(again.stderr) == "from the compile cache"
    assert again.stdout == eager_text.stdout


def test_a_quantized_prompt_head_is_saved_whole(model, tmp_path):
    """Where the int8 output layer has no packed copy, its product for prompts is a graph
    too: where no integer GEMM library serves it (packed_int8.backend: here a process lowered
    to no vector instructions), and in an engine of one sequence (gemma-run's default,
    loading.load); the saved graph must load (an unread dtype attribute once made it
    unloadable: quant.QuantizedLinear.dtype). With a library and several sequences, a prompt's
    logits come from the packed copy eagerly: no graph to load."""
    cache = tmp_path / "cache"
    head = "the output layer for prompts is ready"
    bare = {"ATEN_CPU_CAPABILITY": "default"}
    first = gemma_run(model, cache, "--precompile", "--quantize", "int8", env=bare)
    assert source_of_graph(first.stderr, head) == "compiled"
    run = gemma_run(model, cache, "--prompt", PROMPT, "--quantize", "int8", env=bare)
    assert source_of_graph(run.stderr, head) == "from the compile cache"
    assert source_of_graph(run.stderr) == "from the compile cache"
    native = tmp_path / "native"
    one = gemma_run(model, native, "--prompt", PROMPT, "--quantize", "int8")
    assert head in one.stderr
    several = gemma_run(model, native, "--prompt", PROMPT, "--quantize", "int8", "--max-batch", "2")
    assert (head in several.stderr) == (packed_int8.backend() is None)


def test_precompile_with_speculation_builds_its_graphs_too(model, eager_text, tmp_path):
    """With --speculate, --precompile also builds the verify step of k + 1 rows and the int8
    drafter's one-row step (lookup's verify step is the same call), so that a speculative run
    after it compiles nothing, and still prints the eager engine's greedy text."""
    cache = tmp_path / "cache"
    spec = ["--speculate", "int8", "--speculate-tokens", "3"]
    first = gemma_run(model, cache, "--precompile", *spec)
    assert source_of_graph(first.stderr, "graph for 4 rows and kv bucket 16 is ready") == "compiled"
    assert source_of_graph(first.stderr, f"int8 draft: {READY}") == "compiled"
    assert "decode graphs (with --speculate int8's for 3 drafts) ready" in first.stderr
    run = gemma_run(model, cache, "--prompt", PROMPT, *spec)
    assert "compiling" not in run.stderr, run.stderr
    assert run.stdout == eager_text.stdout and not warnings(run.stderr)


FRESH_LOAD = """
import json, os, sys
from gemma_engine.engine import Engine

compile = sys.argv[2] == "compile"
engine = Engine.from_pretrained(
    sys.argv[1], compile=compile, max_seq_len=16, buckets=[16], max_batch=1, quantize=sys.argv[3]
)
text = engine.generate("The quick brown fox", max_new_tokens=8).token_ids
compiler = [name for name in ("torch._dynamo", "torch._inductor") if name in sys.modules]
print(json.dumps([text, sorted(engine.compile_seconds), compiler]))
"""


def test_a_process_that_loads_its_saved_graphs_never_imports_the_compiler(model, warm_cache):
    """A saved graph loads through AOTInductor's C++ loader (saved_graphs.py), so a fresh
    process whose graphs are saved imports neither Dynamo nor inductor (~1.1-1.9 s of Python
    on two cores), and neither does an eager engine. Building the model on the meta device
    must not import them either (torch's initializers would: layers.Embedding), nor may an
    int8 prompt's logits through a library's packed copy (torch's custom operators import
    Dynamo when called: packed_int8.product)."""
    gemma_run(model, warm_cache, "--precompile", "--quantize", "int8")
    texts = {}
    for compile, quantize in [("compile", "none"), ("no-compile", "none"), ("compile", "int8")]:
        run = subprocess.run(
            [sys.executable, "-c", FRESH_LOAD, str(model), compile, quantize],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
                "GEMMA_ENGINE_CACHE": str(warm_cache),
            },
        )
        assert run.returncode == 0, run.stderr
        text, graphs, compiler = json.loads(run.stdout)
        assert compiler == [], (compile, quantize)
        assert graphs == ([[1, 16]] if compile == "compile" else [])
        texts[compile, quantize] = text
    assert texts["compile", "none"] == texts["no-compile", "none"]


def test_a_graph_that_cannot_be_saved_whole_is_compiled_as_usual(tmp_path, monkeypatch, capsys):
    """torch's ahead-of-time compile is experimental: where it fails, one warning, a marker
    that spares later processes the attempt, and None (the engine then compiles as usual)."""
    model = torch.nn.Linear(4, 4)

    def fails(*args):
        raise RuntimeError("not serializable")

    monkeypatch.setattr(saved_graphs, "build", fails)
    x = torch.ones(1, 4)
    assert saved_graphs.get(tmp_path, model, torch.nn.Linear.forward, (x,)) is None
    (warning,) = capsys.readouterr().err.splitlines()
    assert "cannot be saved whole" in warning and "not serializable" in warning
    (marker,) = (tmp_path / saved_graphs.FOLDER).glob("*.unsaved")
    assert saved_graphs.get(tmp_path, model, torch.nn.Linear.forward, (x,)) is None
    assert capsys.readouterr().err == ""  # tried once per machine, not once per process


UNSAVED = """
import json, sys
from gemma_engine import compile_cache, saved_graphs
from gemma_engine.engine import Engine

def fails(*args):
    raise RuntimeError("not serializable")

trimmed, trim = [], compile_cache.trim
compile_cache.trim = lambda folder, keep=None: trimmed.append(folder) or trim(folder, keep)
saved_graphs.build = fails
engine = Engine.from_pretrained(sys.argv[1], compile=True, max_seq_len=16, buckets=[16])
notices = []
engine.on_compile = notices.append
engine.generate([5, 6, 7], max_new_tokens=2)
print(json.dumps([notices, len(trimmed)]))
"""


def test_a_graph_that_cannot_be_saved_whole_is_announced_once(model, tmp_path):
    """A graph whose export fails is compiled by torch.compile instead: one "compiling" line
    for it (and the one warning), not one per attempt, and the cache is trimmed after it as
    after a saved graph. (A fresh process with a cache of its own: the failure leaves a marker
    there.)"""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    run = subprocess.run(
        [sys.executable, "-c", UNSAVED, str(model)],
        capture_output=True,
        text=True,
        env={**env, "GEMMA_ENGINE_CACHE": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    notices, trimmed = json.loads(run.stdout)
    assert [n.split(" (")[0] for n in notices] == [
        "compiling the decode graph for 1 row and kv bucket 16",
        "the decode graph for 1 row and kv bucket 16 is ready",
    ]
    assert trimmed == 1
    (warning,) = warnings(run.stderr)
    assert "cannot be saved whole" in warning and "not serializable" in warning


def test_a_saved_graph_refuses_other_shapes_and_uses_the_model_s_tensors_in_place(tmp_path):
    """A saved graph holds no weights: the model's parameters and buffers are its constants,
    used in place (a change to them shows in the next call), and its tensor arguments must
    have the shapes it was built for (any strides: the code indexes contiguous ones)."""
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        graph, loaded = saved_graphs.get(tmp_path, model, torch.nn.Linear.forward, (x,))
        assert not loaded
        with pytest.raises(ValueError, match="shapes"):
            graph(torch.ones(3, 4))
        # (close, not equal: the compiled product may round differently from eager addmm)
        torch.testing.assert_close(graph(x), model(x))
        # The same values, column by column in memory, read by inductor's own code (GELU):
        transposed = x.t().contiguous().t()
        assert not transposed.is_contiguous()
        gelu = torch.nn.Sequential(torch.nn.GELU(), model)
        first, _ = saved_graphs.get(tmp_path, gelu, torch.nn.Sequential.forward, (x,))
        torch.testing.assert_close(first(transposed), gelu(x))
        model.weight.mul_(2)
        torch.testing.assert_close(graph(x), model(x))
        again, loaded = saved_graphs.get(tmp_path, model, torch.nn.Linear.forward, (x,))
        assert loaded
        torch.testing.assert_close(again(x), model(x))
        other = torch.nn.Linear(4, 4)  # same shapes: the same file, bound to other tensors
        third, loaded = saved_graphs.get(tmp_path, other, torch.nn.Linear.forward, (x,))
        assert loaded
        torch.testing.assert_close(third(x), other(x))


def test_other_weights_of_the_same_shapes_reuse_the_graph(model, warm_cache, tmp_path):
    """Weights are inputs of the graph, not constants in it."""
    other = tmp_path / "other"
    shutil.copytree(model, other)
    tensors = load_file(other / "model.safetensors")
    save_file({k: v.flip(-1).contiguous() for k, v in tensors.items()}, other / "model.safetensors")
    eager = gemma_run(other, tmp_path / "unused", "--prompt", PROMPT, "--no-compile")
    run = gemma_run(other, warm_cache, "--prompt", PROMPT)
    assert source_of_graph(run.stderr) == "from the compile cache"
    assert run.stdout == eager.stdout


def test_a_cache_made_for_another_torch_or_cpu_is_rebuilt(model, warm_cache, eager_text, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    stamp = cache_folder(cache) / compile_cache.STAMP
    key = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**key, "torch": "2.0.0"}))
    run = gemma_run(model, cache, "--prompt", PROMPT)
    (warning,) = warnings(run.stderr)
    assert "was made for another torch or CPU; it is cleared and rebuilt" in warning
    assert source_of_graph(run.stderr) == "compiled"
    assert run.stdout == eager_text.stdout
    assert json.loads(stamp.read_text()) == key  # stamped again for this machine
    again = gemma_run(model, cache, "--prompt", PROMPT)
    assert source_of_graph(again.stderr) == "from the compile cache" and not warnings(again.stderr)


@pytest.mark.parametrize("which", ["every file", "shared objects"])
def test_broken_cached_files_are_rebuilt(model, warm_cache, eager_text, tmp_path, which):
    """Every cached file overwritten (the saved graph is no package), or only the compiled
    library inside each saved graph's package (the package opens, its code does not load):
    either way the cache is cleared with one warning and the graph built anew."""
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    broken = 0
    for path in cache_folder(cache).rglob("*"):
        if not path.is_file() or path.name == compile_cache.STAMP or not path.stat().st_size:
            continue
        if which == "every file":
            path.write_bytes(b"\x00garbage" * 8)
            broken += 1
        elif path.suffix == saved_graphs.SUFFIX:
            with zipfile.ZipFile(path) as package:
                members = {info: package.read(info) for info in package.infolist()}
            with zipfile.ZipFile(path, "w") as package:
                for info, data in members.items():
                    if info.filename.endswith(".so"):
                        data, broken = b"\x00garbage" * 8, broken + 1
                    package.writestr(info, data)
    assert broken
    temp = tmp_path / "tmp"
    temp.mkdir()
    run = gemma_run(model, cache, "--prompt", PROMPT, env={"TMPDIR": str(temp)})
    assert not list(temp.glob("aotinductor_*"))  # the failed loader's unzipped copy is gone
    assert "Traceback" not in run.stderr
    assert run.stdout == eager_text.stdout
    (warning,) = warnings(run.stderr)
    assert "could not be loaded" in warning and "the cache is cleared" in warning
    assert source_of_graph(run.stderr) == "compiled"
    again = gemma_run(model, cache, "--prompt", PROMPT)
    assert source_of_graph(again.stderr) == "from the compile cache" and not warnings(again.stderr)
    assert again.stdout == eager_text.stdout


def test_a_folder_past_its_budget_loses_its_least_recently_used_entries(tmp_path, monkeypatch):
    """compile_cache.trim, after a graph is built: newest first up to KEEP_BYTES, then only what
    was written within the hour (another process may be building it), the graph just built,
    the stamp, the vector checks, the locks and the markers of graphs that cannot be saved."""
    folder = tmp_path / "machine"
    now = time.time()

    def entry(relative: str, size: int, hours_ago: float) -> None:
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        when = now - hours_ago * 3600
        for p in [path, *path.relative_to(folder).parents][:-1]:  # the file and its folders
            os.utime(folder / p, (when, when))

    entry(compile_cache.STAMP, 10, 300)
    entry(compile_cache.VECTOR_CHECKS, 10, 300)
    entry("locks/a.lock", 10, 300)
    entry("graphs/forward-marker.unsaved", 10, 300)
    entry("graphs/forward-built.pt2", 400, 0)  # just built: stays whatever the size
    entry("ab/cab/kernel.so", 300, 0.5)  # written within the hour
    entry("graphs/forward-used.pt2", 300, 2)  # loaded two hours ago: 1000 bytes so far
    entry("cd/ccd/kernel.so", 300, 24)
    entry("graphs/forward-old.pt2", 300, 48)
    entry("fxgraph/xy/entry", 300, 72)
    monkeypatch.setattr(compile_cache, "KEEP_BYTES", 1000)
    compile_cache.trim(folder, keep=folder / "graphs/forward-built.pt2")
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert left == [
        "ab/cab/kernel.so",
        "graphs/forward-built.pt2",
        "graphs/forward-marker.unsaved",
        "graphs/forward-used.pt2",
        "locks/a.lock",
        compile_cache.STAMP,
        compile_cache.VECTOR_CHECKS,
    ]
    # Within the budget, nothing goes.
    monkeypatch.setattr(compile_cache, "KEEP_BYTES", 1 << 20)
    compile_cache.trim(folder)
    assert len([p for p in folder.rglob("*") if p.is_file()]) == len(left)


def test_a_second_engine_in_the_process_keeps_the_folder(tmp_path, monkeypatch):
    """use() points TorchInductor at the engine's folder; a second engine in the same process
    (tests, a speculative drafter, a reload) must take that folder for its own, not for a
    user's choice (which would cost it its saved graphs)."""
    monkeypatch.setenv("GEMMA_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    first = compile_cache.use()
    assert first is not None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(first)
    assert compile_cache.use() == first
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a user's own"))
    assert compile_cache.use() is None


def test_a_lowered_capability_uses_its_own_folder():
    """What a graph is generated for is part of the key: AVX2 code must not be found by an
    AVX-512 process, nor the reverse."""
    code = (
        "from gemma_engine import compile_cache, cpu\n"
        "print(cpu.capability(), compile_cache.folder_name())"
    )
    names = {}
    for lowered in ("", "avx2", "default"):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env.update({"ATEN_CPU_CAPABILITY": lowered} if lowered else {})
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        capability, names[lowered] = run.stdout.split()
        assert capability.lower() in names[lowered]
    assert names["default"] not in (names[""], names["avx2"])
    if "avx2" not in names[""]:  # an AVX-512 machine
        assert names["avx2"] != names[""]


def test_an_empty_folder_is_stamped_and_a_stampless_one_with_files_set_aside(tmp_path, capsys):
    """An empty folder may be another process's, about to stamp it: no warning. Files without a
    stamp are of unknown origin: one warning, and the folder is made anew."""
    empty = tmp_path / "empty"
    empty.mkdir()
    compile_cache._check_stamp(empty)
    assert json.loads((empty / compile_cache.STAMP).read_text()) == compile_cache.machine_key()
    assert capsys.readouterr().err == ""
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "entry").write_bytes(b"?")
    compile_cache._check_stamp(unknown)
    (warning,) = capsys.readouterr().err.splitlines()
    assert "has no readable stamp; it is cleared and rebuilt" in warning
    assert sorted(p.name for p in unknown.iterdir()) == [compile_cache.STAMP]


VECTOR_SETS = """
import json, sys, torch
from torch._inductor import cpu_vec_isa
from gemma_engine import compile_cache
built = []
check = cpu_vec_isa.VecISA.check_build
def counted(isa, code):
    built.append(str(isa))
    return check(isa, code)
cpu_vec_isa.VecISA.check_build = counted  # below the engine's memory of the answers
if sys.argv[1] == "cache":
    compile_cache.use()
    compile_cache.before_compiling()  # as the engine does before it builds a graph
sets = [[str(isa), isa.build_arch_flags()] for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"sets": sets, "checks_run": len(built)}))
"""


def vector_sets(cache: Path, use_cache: bool = True) -> dict:
    """In a fresh process: the vector instruction sets inductor finds usable (with the flags
    it would compile them with), and how many of its build checks actually ran."""
    env = {**os.environ, "GEMMA_ENGINE_CACHE": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if not use_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "torch-own")
    args = [sys.executable, "-c", VECTOR_SETS, "cache" if use_cache else "plain"]
    run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_inductors_vector_checks_run_once_per_folder(warm_cache, tmp_path):
    """The process that built a graph kept the answer of each of inductor's vector-instruction
    checks; a later process reads them and runs none, and finds the same sets with the same
    flags as inductor's own checks in a process that does not use the engine's folder. An
    answer missing from the file (or a file that is not JSON) makes that check run again."""
    plain = vector_sets(tmp_path, use_cache=False)
    remembered = vector_sets(warm_cache)
    assert remembered["sets"] == plain["sets"] and remembered["checks_run"] == 0
    if plain["checks_run"] == 0:
        return  # not an x86 Linux machine: inductor checks nothing here
    assert remembered["sets"], "an x86 machine has AVX2 at least"
    checks = cache_folder(warm_cache) / compile_cache.VECTOR_CHECKS
    answers = json.loads(checks.read_text())
    assert answers and all(isinstance(a, bool) for a in answers.values())
    other = tmp_path / "cache"
    shutil.copytree(warm_cache, other)
    kept = cache_folder(other) / compile_cache.VECTOR_CHECKS
    kept.write_text("{not json")
    again = vector_sets(other)
    assert again["sets"] == plain["sets"] and again["checks_run"] == plain["checks_run"]
    fresh = json.loads(kept.read_text())  # the answers a process needs, found again
    assert fresh.items() <= answers.items() and len(fresh) == plain["checks_run"]
    first = next(iter(fresh))
    kept.write_text(json.dumps({k: v for k, v in fresh.items() if k != first}))
    again = vector_sets(other)
    assert again["sets"] == plain["sets"] and again["checks_run"] == 1
    assert json.loads(kept.read_text()) == fresh
