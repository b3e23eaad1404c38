"""Tensor parallelism (parallel.py): 2 processes on gloo against the single-process engine.

The reference is the single-process engine, which matches transformers (test_parity.py). Each
group of processes costs seconds to start and a compile costs tens of seconds on a small CPU,
so one group runs every check of the tiny Gemma 1 (MHA), 2 (GQA) and 3 (MQA) checkpoints in
turn, float and int8, eager, Gemma 2 and 3 with their other key/value head layouts (MHA, GQA,
MQA), and each of them compiled too (Gemma 1 and 3 float, Gemma 2 int8);
the tests below compare what it saw.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gemma_engine import Engine, InvalidRequestError, parallel, quant
from gemma_engine.config import GemmaConfig

KINDS = ["gemma", "gemma2", "gemma3"]  # MHA, GQA, MQA
# The other key/value head layouts of Gemma 2 and 3 (float, eager): name -> (kind, KV heads of 4).
LAYOUTS = {
    "gemma2-mha": ("gemma2", 4),
    "gemma2-mqa": ("gemma2", 1),
    "gemma3-mha": ("gemma3", 4),
    "gemma3-gqa": ("gemma3", 2),
}
WORLD = 2
# Compiling is slow here (a minute on 2 busy cores, cold): one graph (kv bucket 16) each of
# Gemma 1 (MHA, float), Gemma 3 (MQA, float) and Gemma 2 (GQA, int8) cut to 2 layers (for
# Gemma 2 and 3 a sliding and a global one).
COMPILED = {
    "gemma-2-layers": {},
    "gemma3-2-layers": {},
    "gemma2-2-layers-int8": {"quantize": "int8"},
}
PROMPTS = ["The quick brown fox", "def main():\n    return"]
MISSING = "model.layers.1.mlp.down_proj.weight"  # the tensor one rank's file lacks


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step_logits(engine: Engine, prompt: list[int], steps: int) -> torch.Tensor:
    """Logits (1 + steps, vocab) of a prompt's last position, then of greedy decode steps
    through engine.step (the compiled graph when compiled), all in kv bucket 16."""
    hidden = engine.prefill(prompt, 0, 0, all_positions=False)
    out = [engine.head(hidden)[0, -1]]
    for i in range(steps):
        token = out[-1].argmax().view(1, 1)
        pos = torch.tensor([len(prompt) + i])
        out.append(engine.step(token, pos, engine.bucket_for(len(prompt) + i + 1))[0, -1])
    return torch.stack(out).float()


def observe(engine: Engine, full: bool) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """What the comparisons read: logits (tensors) and generated tokens (lists)."""
    tensors = {"decode": step_logits(engine, random_ids(5, 1), 10)}
    tokens = {"greedy": engine.generate(random_ids(6, 2), max_new_tokens=9).token_ids}
    if full:
        tensors["score"] = engine.score(random_ids(20, 3))
        batch = engine.generate(PROMPTS, max_new_tokens=8)  # two slots in one step
        tokens["batch"] = [g.token_ids for g in batch]
        seeded = engine.generate(PROMPTS[0], max_new_tokens=8, temperature=0.9, seed=3)
        tokens["seeded"] = seeded.token_ids
        # The global generator differs between processes: the ranks agree by broadcast.
        tokens["unseeded"] = engine.generate(
            PROMPTS[0], max_new_tokens=8, temperature=1.0
        ).token_ids
    return tensors, tokens


def cases(folders: dict[str, str]) -> list[tuple[str, str, dict]]:
    """(name, folder, from_pretrained arguments) of each engine both sides build."""
    base = dict(max_seq_len=64, buckets=[16, 32, 64], max_batch=2, compile=False)
    out = []
    for kind in KINDS:
        out.append((kind, folders[kind], base))
        out.append((f"{kind}-int8", folders[kind], {**base, "quantize": "int8"}))
    out += [(name, folders[name], base) for name in LAYOUTS]
    out.append(("gemma2-saved-int8", folders["gemma2-saved-int8"], base))  # sliced int8 bytes
    # int4 groups of 8 fall on the same columns on each rank as in one process
    out.append(("gemma2-int4", folders["gemma2"], {**base, "quantize": "int4", "group_size": 8}))
    compiled = {**base, "compile": True, "max_batch": 1, "buckets": [16, 64]}
    for name, extra in COMPILED.items():
        out.append((name, folders[name], {**base, **extra}))  # the reference, eager
        out.append((f"{name}-compiled", folders[name], {**compiled, **extra}))
    return out


def _no_bf16_prompts() -> None:
    quant._cpu_bf16_matmul = lambda: False  # fp32 prompt products on both sides, as test_quant


def _worker(rank: int, rendezvous: str, folders: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    _no_bf16_prompts()
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD
    )
    results = {}
    for name, folder, kwargs in cases(folders):
        start = time.perf_counter()
        engine = Engine.from_pretrained(folder, **kwargs)
        assert engine.model.tp is not None and engine.model.tp.ranks.world == WORLD
        tensors, tokens = observe(engine, full=name in KINDS)
        tokens["seconds"] = round(time.perf_counter() - start, 1)  # (for a slow run)
        tensors["kv_cache_bytes"] = torch.tensor(engine.kv_cache_bytes)
        results[name] = tokens
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out}/{name}.safetensors")
    try:  # an error every rank meets is raised as itself
        Engine.from_pretrained(f"{out}/no-such-folder", compile=False)
    except Exception as err:
        results["same error"] = {"type": type(err).__name__, "message": str(err)}
    Path(f"{out}/tokens{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, tmp_path_factory, tokenizer_file) -> dict[str, str]:
    from conftest import save_tiny, tiny_configs

    out = {kind: str(folder) for kind, (folder, _) in tiny_checkpoints.items()}

    def save(name: str, kind: str, config) -> None:
        folder = tmp_path_factory.mktemp(name)
        save_tiny(kind, folder, tokenizer_file, config=config)
        out[name] = str(folder)

    for name in COMPILED:
        kind = name.split("-")[0]
        config = tiny_configs()[kind]
        config.num_hidden_layers = 2
        if hasattr(config, "layer_types"):  # Gemma 1 has only global layers
            config.layer_types = ["sliding_attention", "full_attention"]
        save(name, kind, config)
    for name, (kind, kv_heads) in LAYOUTS.items():
        config = tiny_configs()[kind]
        config.num_key_value_heads = kv_heads
        save(name, kind, config)
    saved = tmp_path_factory.mktemp("saved") / "gemma2-int8"
    Engine.from_pretrained(out["gemma2"], compile=False, quantize="int8").save_pretrained(saved)
    out["gemma2-saved-int8"] = str(saved)
    return out


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Run every case on 2 ranks; (rank 0's tensors folder, each rank's tokens)."""
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(str(out / "rendezvous"), folders, str(out)), nprocs=WORLD)
    return out, [json.loads((out / f"tokens{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single(folders) -> dict[str, tuple[dict, dict]]:
    """The same cases in this process, one engine each (eager: the compiled case's reference
    is the eager engine)."""
    saved = quant._cpu_bf16_matmul
    _no_bf16_prompts()
    try:
        out = {}
        for name, folder, kwargs in cases(folders):
            if name.endswith("-compiled"):
                continue
            engine = Engine.from_pretrained(folder, **kwargs)
            assert engine.model.tp is None
            out[name] = observe(engine, full=name in KINDS)
            out[name][0]["kv_cache_bytes"] = torch.tensor(engine.kv_cache_bytes)
        return out
    finally:
        quant._cpu_bf16_matmul = saved


def _load(sharded, name):
    from safetensors.torch import load_file

    return load_file(str(sharded[0] / f"{name}.safetensors")), sharded[1][0][name]


@pytest.mark.parametrize(
    "name",
    [n for k in KINDS for n in (k, f"{k}-int8")]
    + list(LAYOUTS)
    + ["gemma2-saved-int8", "gemma2-int4"],
)
def test_logits_and_greedy_tokens_match_one_process(name, sharded, single):
    tensors, tokens = _load(sharded, name)
    ref_tensors, ref_tokens = single[name]
    for key, expected in ref_tensors.items():
        if key == "kv_cache_bytes":
            continue
        torch.testing.assert_close(tensors[key], expected, atol=1e-5, rtol=0, msg=key)
    assert tokens["greedy"] == ref_tokens["greedy"]
    if "batch" in ref_tokens:
        assert tokens["batch"] == ref_tokens["batch"]
        assert tokens["seeded"] == ref_tokens["seeded"]


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_decode_matches_one_process(name, sharded, single):
    tensors, tokens = _load(sharded, f"{name}-compiled")
    ref_tensors, ref_tokens = single[name]
    torch.testing.assert_close(tensors["decode"], ref_tensors["decode"], atol=1e-5, rtol=0)
    assert tokens["greedy"] == ref_tokens["greedy"]


def test_every_rank_samples_the_same_tokens(sharded):
    first, second = ({k: {**v, "seconds": 0} for k, v in r.items()} for r in sharded[1])
    assert first == second  # unseeded sampling included: rank 0's tokens are broadcast
    # Up to 8 tokens: an unseeded draw may end early on an end-of-turn token (seen: 6).
    assert 1 <= len(first["gemma"]["unseeded"]) <= 8
    assert first["same error"]["type"] == "CheckpointNotFoundError"  # as itself, on every rank
    assert "no-such-folder" in first["same error"]["message"]


@pytest.mark.parametrize("kind", KINDS + list(LAYOUTS))
def test_kv_cache_holds_the_ranks_heads(kind, sharded, single, folders):
    """Split KV heads halve the cache per rank; MQA's one head is copied to each rank."""
    tensors, _ = _load(sharded, kind)
    kv = config_of(folders, kind)
    whole = single[kind][0]["kv_cache_bytes"].item()
    per_rank = tensors["kv_cache_bytes"].item()
    assert per_rank == whole // min(WORLD, kv.num_key_value_heads)


# -- an error on one rank -----------------------------------------------------------------------
def _failing_worker(rank: int, rendezvous: str, folders: list[str], out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD
    )
    start = time.perf_counter()
    try:
        Engine.from_pretrained(folders[rank], compile=False, max_seq_len=64)
        result = {"error": None}
    except Exception as err:
        result = {"error": type(err).__name__, "message": str(err)}
    result["seconds"] = time.perf_counter() - start
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(result))
    os._exit(2 if result["error"] else 0)  # as gemma-run does under torch.distributed


def test_an_error_on_one_rank_ends_every_rank_with_its_message(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(folders["gemma3"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[MISSING]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    context = mp.start_processes(
        _failing_worker,
        args=(str(tmp_path / "rendezvous"), [folders["gemma3"], str(broken)], str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120  # process start-up (imports) included
    for process in context.processes:
        process.join(max(deadline - time.monotonic(), 0))
    codes = [p.exitcode for p in context.processes]
    for p in context.processes:
        if p.exitcode is None:
            p.kill()
    assert codes == [2, 2], "a rank did not end"
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["error"] == "ParallelError"
        assert result["message"].startswith(f"rank 1 of {WORLD} failed: CheckpointError")
        assert MISSING in result["message"]
        assert result["seconds"] < 10  # agreed right after loading, not a collective timeout


# -- torchrun and the command line ----------------------------------------------------------
def test_torchrun_gemma_run_prints_once_what_one_process_prints(folders, capsys):
    from gemma_engine.cli import main

    args = ["--model", folders["gemma3"], "--prompt", PROMPTS[0], "--max-new-tokens", "8"]
    args += ["--no-compile", "--max-seq-len", "64"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    script = shutil.which("gemma-run") or str(Path(sys.executable).parent / "gemma-run")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD)]
        + ["--no-python", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == expected  # rank 0's text only
    assert len(re.findall(r"gemma-run: \d+ prompt tokens", run.stderr)) == 1  # one summary
    assert run.stderr.count("fewer key/value heads than the 2 ranks") == 1  # MQA, rank 0


# -- sizes, without processes ---------------------------------------------------------------------
def config_of(folders, kind: str) -> GemmaConfig:
    return GemmaConfig.from_hf(json.loads(Path(folders[kind], "config.json").read_text()))


def test_each_rank_reads_the_kv_heads_its_queries_use(folders):
    gqa = config_of(folders, "gemma2")  # 4 query heads, 2 KV heads
    for world, starts in [(2, [0, 1]), (4, [0, 0, 1, 1])]:
        shards = [parallel.Ranks(r, world, "g").shard(gqa) for r in range(world)]
        assert [s.kv_start for s in shards] == starts
        assert all(s.kv_heads == max(2 // world, 1) for s in shards)
        assert all(s.replicated_kv == (world > 2) for s in shards)
    mha = config_of(folders, "gemma")
    three = replace(mha, num_attention_heads=3, num_key_value_heads=3, layers=())
    vocab = parallel.Ranks(2, 3, "g").shard(three)  # 512 rows over 3
    assert (vocab.vocab, vocab.vocab_start) == (171, 342)  # padded: 342 + 171 > 512


def test_sizes_that_do_not_split_are_refused_by_name(folders):
    mha, gqa = config_of(folders, "gemma"), config_of(folders, "gemma2")
    with pytest.raises(
        InvalidRequestError, match=r"num_attention_heads \(4\) to be a multiple of 3"
    ):
        parallel.Ranks(0, 3, "g").shard(mha)
    with pytest.raises(
        InvalidRequestError, match=r"intermediate_size \(90\) to be a multiple of 4"
    ):
        parallel.Ranks(0, 4, "g").shard(replace(mha, intermediate_size=90))
    with pytest.raises(InvalidRequestError, match=r"num_key_value_heads \(2\) to be a multiple or"):
        parallel.Ranks(0, 3, "g").shard(replace(gqa, num_attention_heads=6))


def test_the_last_ranks_vocabulary_slice_is_padded_with_zero_rows(folders, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    mha = config_of(folders, "gemma")
    three = replace(mha, num_attention_heads=3, num_key_value_heads=3, layers=())
    table = torch.randn(512, 64)
    save_file({"model.embed_tokens.weight": table}, tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:
        rows = [
            parallel.Ranks(r, 3, "g")
            .shard(three)
            .read("model.embed_tokens.weight", f.get_slice("model.embed_tokens.weight"))
            for r in range(3)
        ]
    assert [r.shape[0] for r in rows] == [171, 171, 171]
    torch.testing.assert_close(torch.cat(rows)[:512], table, atol=0, rtol=0)
    assert not rows[2][-1].any()


def test_the_server_refuses_to_run_under_torchrun(monkeypatch, capsys):
    from gemma_engine.server import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--no-compile"]) == 2
    assert "the server runs in one process" in capsys.readouterr().err
