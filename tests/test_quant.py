"""Weight-only int8/int4: the formats, the kernels, and parity with transformers.

The reference is transformers run on the dequantized weights: a quantized engine must compute
exactly the model its quantized weights describe, on every path (prompt, compiled decode,
saved and reloaded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gemma_engine import Engine, InvalidRequestError, cpu, packed_int8, quant, quant_kernels
from gemma_engine.cli import main as cli_main

KIND = "gemma3"  # MQA, QK-norm, sliding and global layers


@pytest.fixture(autouse=True)
def fp32_prompts(monkeypatch):
    """Prompt matmuls in fp32, so that the comparison is tight (bf16 is tested on its own)."""
    monkeypatch.setattr(quant, "_cpu_bf16_matmul", lambda: False)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def dequantized_reference(engine: Engine, reference):
    """A copy of the transformers model with the engine's quantized weights, expanded."""
    import copy

    ref = copy.deepcopy(reference)
    state = {}
    for name, module in engine.model.named_modules():
        if isinstance(module, quant.QuantizedLinear):
            state[f"{name}.weight"] = module.dequantize(torch.float32)
    missing = ref.load_state_dict(state, strict=False)
    quantized = {k for k in state}
    assert not [k for k in missing.unexpected_keys]
    assert "model.embed_tokens.weight" in quantized  # the embedding is quantized too
    assert len(quantized) == 1 + 7 * len(engine.model.model.layers)
    return ref.eval()


@pytest.mark.parametrize("group", [8, 32])
def test_int4_round_trip_error_is_at_most_half_a_step(group):
    w = torch.randn(48, 128) * torch.linspace(0.01, 3, 128)  # columns of very different sizes
    packed, scale, offset = quant.quantize_int4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 64)
    assert scale.shape == offset.shape == (48, 128 // group)
    back = quant.dequantize_int4(packed, scale, offset, torch.float32)
    step = scale.float().repeat_interleave(group, dim=1)
    # Half a step, plus the float16 rounding of scale and offset.
    assert ((back - w).abs() <= 0.5 * step + 2e-3 * w.abs().amax()).all()
    q = torch.cat((packed & 15, packed >> 4), dim=1)
    assert q.max() <= 15 and q.unique().numel() > 8


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = torch.randn(64, 96) * torch.linspace(0.01, 3, 64)[:, None]
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    assert q.abs().amax(1).eq(127).all()  # every row uses its full range
    # The textbook definition (quantize_int8 computes it in fewer passes).
    assert torch.equal(scale, w.abs().amax(1) / 127)
    assert torch.equal(q, torch.round(w / scale[:, None]).to(torch.int8))
    back = quant.dequantize_int8(q, scale, torch.float32)
    assert ((back - w).abs() <= 0.5 * scale[:, None] * (1 + 1e-5)).all()


@pytest.mark.parametrize("words", [True, False])  # int8 blocks of int32 words or of bytes
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("rows", [300, 250, 64])  # padded: 300 one row group, 250 four
def test_compiled_matvecs_match_the_dequantized_product(lanes, rows, words):
    """The decode kernels on the kernel layout, against the product with expanded weights."""
    torch.manual_seed(0)
    w, x = torch.randn(rows, 256), torch.randn(1, 1, 256)
    q8 = quant.quantize_int8(w)
    q4 = quant.quantize_int4(w, 32)
    expect8 = x @ quant.dequantize_int8(*q8, torch.float32).T
    expect4 = x @ quant.dequantize_int4(*q4, torch.float32).T
    words8 = quant_kernels.block_int8(q8[0], lanes, words)
    assert words8.dtype == (torch.int32 if words else torch.int8)
    blocked4 = quant_kernels.block_int4(*q4, lanes)
    got8 = torch.compile(quant_kernels.matvec_int8, fullgraph=True)(x, words8, q8[1])
    got4 = torch.compile(quant_kernels.matvec_int4, fullgraph=True)(x, *blocked4, rows)
    torch.testing.assert_close(got8, expect8, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got4, expect4, atol=1e-4, rtol=1e-5)
    # The layouts are lossless: saved tensors come back bit for bit.
    assert torch.equal(quant_kernels.unblock_int8(words8, rows), q8[0])
    for a, b in zip(quant_kernels.unblock_int4(*blocked4, rows), q4, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("words", [True, False])
def test_compiled_int8_rows_equal_each_rows_own_product(words):
    """A product of several rows reads the matrix as one row group per row
    (quant_kernels.matvec_int8_rows), not quant_kernels.STREAMS of them: each output is still
    the one-row kernel's sum, bit for bit, and matches the expanded weights."""
    torch._dynamo.reset()  # the test above compiled matvec_int8 for 12 shapes: past the limit
    torch.manual_seed(0)
    w, x = torch.randn(512, 256), torch.randn(3, 256)
    q, scale = quant.quantize_int8(w)
    blocks = quant_kernels.block_int8(q, 8, words)
    got = torch.compile(quant_kernels.matvec_int8_rows, fullgraph=True)(x, blocks, scale)
    one = torch.compile(quant_kernels.matvec_int8, fullgraph=True)
    assert torch.equal(got, torch.cat([one(row[None], blocks, scale) for row in x]))
    expect = x @ quant.dequantize_int8(q, scale, torch.float32).T
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints):
    folder, reference = tiny_checkpoints[KIND]
    out = {}
    for method, group in [("int8", None), ("int4", 16)]:
        engine = Engine.from_pretrained(
            folder,
            quantize=method,
            group_size=group,
            compile=True,
            max_seq_len=64,
            buckets=[32],
        )
        out[method] = (engine, dequantized_reference(engine, reference))
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_score_matches_transformers_on_dequantized_weights(method, quantized):
    engine, ref = quantized[method]
    for seed, length in [(0, 9), (1, 40)]:
        ids = random_ids(length, seed)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(engine.score(ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_compiled_decode_matches_transformers(method, quantized):
    """Greedy decode runs the fused kernels (prompt eager, head and steps compiled)."""
    engine, ref = quantized[method]
    got = assert_greedy_decode_matches(engine, ref)
    assert got.stats["buckets_compiled"] == [32, 64]  # the steps ran compiled


def assert_greedy_decode_matches(engine: Engine, ref):
    prompt = random_ids(6, 3)
    expected = ref.generate(
        torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False
    )[0, len(prompt) :].tolist()
    got = engine.generate(prompt, max_new_tokens=30)
    assert got.token_ids == expected[: len(got.token_ids)]
    assert len(got.token_ids) >= 20 or got.finish_reason == "stop"
    return got


def test_an_engine_of_one_sequence_goes_without_the_packed_copy(tiny_checkpoints):
    """Compiled with max_batch=1 (gemma-run's default), the int8 output layer gets no packed
    copy (its prepack took seconds on AVX2, loading.load): the prompt's logits come from a
    compiled graph instead, and decode still matches transformers."""
    folder, reference = tiny_checkpoints[KIND]
    engine = Engine.from_pretrained(
        folder, quantize="int8", compile=True, max_seq_len=64, buckets=[32], max_batch=1
    )
    head = engine.model.output_layer()
    assert not head.packed and not hasattr(head.weight, "_gemma_packed")
    assert engine.graphs.compiles_head
    assert_greedy_decode_matches(engine, dequantized_reference(engine, reference))
    # Eager, or several sequences: the copy is there for their products.
    for kwargs in ({"compile": False, "max_batch": 1}, {"compile": True, "max_batch": 2}):
        other = Engine.from_pretrained(folder, quantize="int8", max_seq_len=64, **kwargs)
        assert other.model.output_layer().packed == (packed_int8.backend() is not None)


def test_bf16_prompt_matmuls_stay_close(monkeypatch, quantized):
    """On a CPU with bf16 matmuls, prompts through quantized layers multiply in bf16."""
    monkeypatch.setattr(quant, "_cpu_bf16_matmul", lambda: True)
    engine, ref = quantized["int8"]
    ids = random_ids(40, 5)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = engine.score(ids)
    err = (got - expected).abs().max() / expected.abs().max()
    assert 0 < err < 3e-2  # not exact, since bf16 rounds, but close


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_saved_quantized_model_reloads_without_requantizing(method, quantized, tmp_path):
    engine, _ = quantized[method]
    saved = engine.save_pretrained(tmp_path / "q")
    assert sorted(p.name for p in saved.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    entry = json.loads((saved / "config.json").read_text())[quant.CONFIG_KEY]
    assert entry["method"] == method
    again = Engine.from_pretrained(saved, compile=False, max_seq_len=64)
    assert again.quantization == engine.quantization
    for (name, a), (_, b) in zip(
        engine.model.state_dict().items(), again.model.state_dict().items(), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids = random_ids(20, 7)
    torch.testing.assert_close(again.score(ids), engine.score(ids), atol=0, rtol=0)
    with pytest.raises(InvalidRequestError, match="already quantized"):
        Engine.from_pretrained(saved, quantize="int4" if method == "int8" else "int8")
    with pytest.raises(InvalidRequestError, match="already exists"):
        engine.save_pretrained(saved)
    assert not list(tmp_path.glob(".*partial*"))  # no half-written folder left behind


def test_save_unquantized_round_trips(tiny_checkpoints, tmp_path):
    folder, _ = tiny_checkpoints["gemma"]
    engine = Engine.from_pretrained(folder, compile=False, max_seq_len=64)
    again = Engine.from_pretrained(engine.save_pretrained(tmp_path / "f"), compile=False)
    ids = random_ids(12, 1)
    torch.testing.assert_close(again.score(ids), engine.score(ids), atol=0, rtol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(quantize="int3"), "quantize must be one of none, int8, int4"),
        (dict(quantize="int8", group_size=32), "group_size applies only"),
        (dict(quantize="int4", group_size=7), "multiple of 8"),
        (dict(quantize="int4", group_size=64), "multiple of 2 x group_size"),
    ],
)
def test_bad_quantize_requests(kwargs, message, tiny_checkpoints):
    folder, _ = tiny_checkpoints[KIND]
    with pytest.raises(InvalidRequestError, match=message):
        Engine.from_pretrained(folder, compile=False, **kwargs)


def test_default_group_size_fits_small_widths(tiny_checkpoints):
    folder, _ = tiny_checkpoints[KIND]  # widths 64 and 96: 64 does not fit, 16 does
    engine = Engine.from_pretrained(folder, quantize="int4", compile=False, max_seq_len=32)
    assert engine.quantization == ("int4", 16)


def test_cli_quantize(tiny_checkpoints, capsys):
    folder, _ = tiny_checkpoints[KIND]
    code = cli_main(
        [
            "--model",
            str(folder),
            "--prompt",
            "The quick",
            "--quantize",
            "int8",
            "--max-new-tokens",
            "5",
            "--no-compile",
        ]
    )
    assert code == 0
    assert "int8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--model", str(folder), "--prompt", "x", "--quantize", "int5"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int5'" in capsys.readouterr().err


def test_kernel_layout_follows_the_capability(quantized):
    """Quantized matrices are blocked by the vector width of the capability in effect; the
    int8 output layer also carries a packed copy for the GEMM library of that capability."""
    expected = os.environ.get("GEMMA_TEST_CAPABILITY", cpu.capability())
    assert cpu.capability() == expected  # a lowered run really runs lowered
    library = {"AVX512": "onednn", "AVX2": "fbgemm"}.get(expected)
    assert packed_int8.backend() == library
    for method in ("int8", "int4"):
        model = quantized[method][0].model
        head = model.output_layer()
        assert isinstance(head, quant.Int8Linear)  # int8 under int4 too
        assert head.packed == (library is not None)
        if library is not None:
            assert head.weight._gemma_packed[0] == library
        blocked = {m for m in model.modules() if isinstance(m, quant.QuantizedLinear)}
        lanes = {m.lanes for m in blocked}
        assert lanes == {cpu.vector_lanes()} == {16 if expected == "AVX512" else 8}
        # int8 blocks hold bytes under AVX-512, int32 words elsewhere (quant_kernels.int8_words)
        if method == "int8":
            int8 = {m.weight.dtype for m in blocked}
            assert int8 == {torch.int8 if expected == "AVX512" else torch.int32}


@pytest.mark.parametrize("library", ["onednn", "fbgemm"])
def test_packed_int8_product_matches_the_dequantized_product(library):
    """The libraries' integer GEMM on activations split into 7-bit rows (packed_int8.py),
    against the product with expanded weights: eager, compiled, one row and a batch."""
    if library not in torch.backends.quantized.supported_engines:
        pytest.fail(f"this torch build has no {library}: the engine's int8 head needs it")
    torch.manual_seed(0)
    w = torch.randn(300, 256)
    q, scale = quant.quantize_int8(w)
    packed_int8.pack(q, scale, library)
    x = torch.randn(5, 256)
    x[1, 7] *= 300  # an outlier: the other entries of its row keep their precision
    x[2] = 0  # an all-zero row
    x[3] *= 1e-20  # a tiny one
    expect = x @ quant.dequantize_int8(q, scale, torch.float32).T
    got = packed_int8.product(x, q)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-5)
    assert got[2].eq(0).all()
    # The copy may sit on a blocked matrix (quant.to_kernel_layout), whose rows are then given.
    blocked = quant_kernels.block_int8(q, 8)
    blocked._gemma_packed = q._gemma_packed
    assert torch.equal(packed_int8.product(x, blocked, 300), got)
    torch.testing.assert_close(got[3] * 1e20, expect[3] * 1e20, atol=1e-4, rtol=1e-5)
    # Each row is computed as on its own, bit for bit, eager or compiled (batched decode).
    solo = torch.cat([packed_int8.product(x[i : i + 1], q) for i in range(len(x))])
    assert torch.equal(got, solo)
    compiled = torch.compile(packed_int8.product, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x[None, :, None], q), got[None, :, None])
    # bf16 activations in, bf16 out
    half = packed_int8.product(x.bfloat16(), q)
    assert half.dtype == torch.bfloat16


def test_packed_int8_product_needs_a_packed_copy():
    q, scale = quant.quantize_int8(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="no packed copy"):
        packed_int8.product(torch.randn(1, 32), q)


def test_under_a_lower_capability(tmp_path):
    """Every test above again, in a process whose kernels are one capability lower.

    On an AVX-512 machine that is AVX2 (the path of Zen 2/3 and many cloud CPUs), on an AVX2
    machine the scalar fallback: a kernel taken only on one kind of CPU is still checked on
    every machine. The child gets its own inductor cache (see cpu.isolate_compile_cache).
    """
    lower = "AVX2" if cpu.capability() == "AVX512" else "DEFAULT"
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = dict(
        os.environ,
        ATEN_CPU_CAPABILITY=lower.lower(),
        GEMMA_TEST_CAPABILITY=lower,
        TORCHINDUCTOR_CACHE_DIR=f"{default_cache_dir()}_{lower.lower()}",
    )
    if lower == "AVX2":  # AVX2 code only, as GCC emits it on Zen 3 (-march=native there)
        env["TORCHINDUCTOR_CPP_MARCH"] = "znver3"
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # and the GEMM libraries' own ISA caps
        env["FBGEMM_ENABLE_INSTRUCTIONS"] = "AVX2"
        env["TORCHINDUCTOR_CACHE_DIR"] += "_znver3"
    this = Path(__file__)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(this),
            "-k",
            "not under_a_lower_capability and not cli",
            "--basetemp",
            str(tmp_path / "t"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=this.parent.parent,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
