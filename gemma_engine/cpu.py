"""What this process's CPU runs: PyTorch's kernel capability and inductor's vector width.

PyTorch picks its CPU kernels once per process from the CPU's instruction sets ("AVX2",
"AVX512", ...), and ``ATEN_CPU_CAPABILITY=avx2`` lowers that choice for ATen and for inductor's
generated code alike, which lets one machine check the paths another kind of CPU takes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path

import torch

# int32 lanes of inductor's vectors per capability (its VecAVX2 is 256 bits, VecAVX512 512).
# Elsewhere (NEON, SVE, scalar) 8 is a reasonable block; only the two x86 kinds are measured.
_LANES = {"AVX512": 16, "AVX2": 8}


@functools.cache
def capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def vector_lanes() -> int:
    """32-bit lanes in one of inductor's CPU vectors under this process's capability."""
    return _LANES.get(capability(), 8)


@functools.cache
def cpuinfo_fields() -> dict[str, str] | None:
    """The first value of each field of /proc/cpuinfo (its first 200 kB), or None where the
    platform has no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")[:200_000]
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


@functools.cache
def vendor() -> str:
    """The CPU's vendor ("GenuineIntel", "AuthenticAMD", ...), or "" where it is not known."""
    fields = cpuinfo_fields()
    # Elsewhere (Windows): "Intel64 Family 6 Model 85 Stepping 4, GenuineIntel".
    text = fields.get("vendor_id", "") if fields is not None else platform.processor()
    for name in ("GenuineIntel", "AuthenticAMD", "HygonGenuine"):
        if name in text:
            return name
    return ""


# Whether one token's product with a float output layer (Gemma's tied embedding, 262k rows
# for Gemma 3) is PyTorch's BLAS (MKL on x86) rather than inductor's fused multiply-reduce
# (layers.linear) in a compiled CPU step. On the default model's 262,144 x 640 fp32 matrix
# (scripts/bench_kernels.py): MKL ahead on an Intel Xeon (AVX-512, AMX), 26.6 against 30.4 ms;
# level on an AMD Zen 3 (47.4 and 48.0 ms, both at the bandwidth bound); on an AMD EPYC (Zen 4,
# AVX-512) MKL 56-58 ms against 23.5 ms, its single-column product running on one thread
# whether given one or two (BENCHMARKS.md). So MKL on Intel CPUs, the fused reduction on AMD's
# (and Hygon's, Zen cores too), and the library elsewhere, where nothing was measured. A
# module constant, not a call, because the model's compiled code reads it while tracing.
LIBRARY_GEMV_FOR_OUTPUT = vendor() not in ("AuthenticAMD", "HygonGenuine")


def isolate_compile_cache() -> None:
    """Give a lowered capability its own TorchInductor cache folder.

    TorchInductor's on-disk graph cache does not key on the capability (torch 2.13): a graph
    generated for 8-lane AVX2 vectors and found again in a full-AVX-512 process is rebuilt
    with 16-lane vectors under loops that step by 8, and writes past its buffers (seen here as
    heap corruption at exit). A process that sets ``ATEN_CPU_CAPABILITY`` without its own
    ``TORCHINDUCTOR_CACHE_DIR`` therefore gets a sibling folder named after the capability.
    """
    if "ATEN_CPU_CAPABILITY" not in os.environ or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{capability().lower()}"


@functools.cache
def _gcc_12_or_newer() -> bool:
    from torch._inductor import cpp_builder

    try:
        return cpp_builder.is_gcc() and not cpp_builder._is_gcc_version_less_than(
            cpp_builder.get_cpp_compiler(), 12
        )
    except Exception:  # no compiler found: inductor will say so itself when it compiles
        return False


def compile_config() -> contextlib.AbstractContextManager:
    """Inductor settings for the engine's graphs, entered around every compiled call (they
    change only these graphs, and saved_graphs.py keys on them).

    - Floating-point contraction: inductor compiles its C++ with ``-ffp-contract=off`` so
      that a graph rounds as eager does, which leaves every multiply-accumulate of the decode
      products a multiply and an add. Fused (one rounding instead of two, so no less
      accurate), an int8 decode step took 0.55 ms less under AVX-512 (20.07 -> 19.52 ms,
      2026-12-05). Under AVX2, where the int8 kernels run out of arithmetic before bandwidth,
      one process each way first measured it 1.9 ms slower (31.05 -> 32.93 ms, 2026-12-05,
      on kernels since rewritten); three alternating pairs of fresh processes on today's
      kernels, 300 steps each, measured it faster: 14.63 / 15.68 / 15.06 ms without, 14.17 /
      14.27 / 14.17 ms with (the project's VM lowered to AVX2, 2026-12-06; BENCHMARKS.md).
    - Under AVX2, ATen's ``Vectorized<int32_t>::loadu(ptr, count)`` (which inductor emits for
      every integer load) copies through a 32-byte stack buffer. GCC removes that buffer only
      if it expands the copy as one 256-bit move; its default tuning for AVX2 CPUs moves 128
      bits at a time, and the two half stores then stall the full load (store forwarding
      fails): the quantized decode kernels ran 3-4x slower (BENCHMARKS.md). ``-mmove-max=256``
      (GCC 12+) lets it use whole vectors.
    """
    cfg = torch._inductor.config.cpp
    settings = {}
    if capability() in ("AVX512", "AVX2"):
        settings["cpp.enable_floating_point_contract_flag"] = "fast"
    if (
        capability() == "AVX2"
        and platform.machine() in ("x86_64", "AMD64")
        and "move-max" not in (cfg.march or "")
        and _gcc_12_or_newer()
    ):
        settings["cpp.march"] = f"{cfg.march or 'native'} -mmove-max=256 -mstore-max=256"
    return torch._inductor.config.patch(settings)
