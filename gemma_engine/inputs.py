"""Checks of what a caller passes in: devices, dtypes, prompts, token ids, generation settings.

Each turns a value that would fail deep inside torch or a tokenizer (a pybind cast error, a
CUDA assertion, an embedding index error) into an ``InvalidRequestError`` that says what is
wrong and what to pass instead.

Whole numbers (token ids, max_new_tokens, top_k, seed) are Python ints or anything that
converts losslessly through ``__index__`` (numpy integers, 0-d integer tensors), and are
converted to int; ``bool`` is refused (``True`` is not a token id), as are floats, even 3.0.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from .errors import InvalidRequestError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# Below this a temperature divides logits into overflow (inf - inf = nan in the softmax);
# vLLM treats the same threshold as greedy. Here it is refused: 0 means greedy.
MIN_TEMPERATURE = 1e-5
MAX_SEED = (1 << 64) - 1  # torch.Generator.manual_seed takes 64 bits


def whole_number(value: Any, name: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; bools and floats are refused."""
    if isinstance(value, bool) or hasattr(value, "dtype") and value.dtype == torch.bool:
        raise InvalidRequestError(f"{name} must be a whole number, not the bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidRequestError(
            f"{name} must be a whole number, not {type(value).__name__} {value!r:.40}"
        ) from None
    if number < low or (high is not None and number > high):
        bound = f"from {low:,} to {high:,}" if high is not None else f">= {low:,}"
        raise InvalidRequestError(f"{name} must be a whole number {bound}, got {number:,}")
    return number


def real_number(value: Any, name: str) -> float:
    """``value`` as a finite float; bools, strings and NaN/inf are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: cuda if available when None; cpu or an existing cuda device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str):
        try:
            parsed = torch.device(device.strip())
        except (RuntimeError, ValueError):
            raise InvalidRequestError(
                f"device {device!r} is not a device name; use cpu, cuda or cuda:N"
            ) from None
    elif isinstance(device, torch.device):
        parsed = device
    else:
        raise InvalidRequestError(f"device must be a string such as 'cpu', not {device!r:.40}")
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise InvalidRequestError(
            f"device {str(device)!r} is not supported; gemma-engine runs on cpu or cuda"
        )
    if not torch.cuda.is_available():
        why = (
            "this build of torch has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA GPU is visible"
        )
        raise InvalidRequestError(
            f"device {str(device)!r} was asked for but {why}; use --device cpu (device='cpu'), "
            "or install a CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise InvalidRequestError(
            f"device {str(device)!r} does not exist: this machine has {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    return parsed


def parse_dtype(dtype: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """A model (or KV cache, ``what``) dtype from a name (float32, bf16, ...) or one of those
    torch dtypes."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InvalidRequestError(
                f"{what} {dtype} is not supported; use float32, bfloat16 or float16"
            )
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidRequestError(f"{what} {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Refuses a dtype the device cannot compute in (bfloat16 on a pre-Ampere GPU)."""
    if (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise InvalidRequestError(
            f"{torch.cuda.get_device_name(device)} has no bfloat16 support; pass "
            "--dtype float16 (dtype='float16') or float32"
        )
    return dtype


def check_text(text: Any, what: str = "the prompt") -> str:
    """A str that encodes as UTF-8 (no lone surrogates, which no tokenizer can take)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a str, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            f"{what} holds a lone surrogate {text[err.start]!r} at character {err.start}, which "
            "is not text; decode input bytes as UTF-8 with errors='strict' or 'replace'"
        ) from None
    return text


def check_token_ids(ids: Any, vocab_size: int) -> list[int]:
    """A list of ints, each a row of the vocabulary (see the module doc for what converts)."""
    out = []
    for i, token in enumerate(ids):
        try:
            out.append(whole_number(token, f"token id {i}", 0, vocab_size - 1))
        except InvalidRequestError as err:
            raise InvalidRequestError(
                f"{err} (the vocabulary has ids 0..{vocab_size - 1})"
            ) from None
    return out


def check_generation_args(max_new_tokens: Any, stop: Any) -> tuple[int, list[str]]:
    """(max_new_tokens, stop strings) of a request."""
    count = whole_number(max_new_tokens, "max_new_tokens", 1)
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        stops = []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError("stop must be a non-empty string or a list of them")
    return count, [check_text(s, "a stop string") for s in stops]
