"""Find a checkpoint (folder, GGUF file, hub id or the default) and load it strictly.

Weights come only from safetensors (memory-mapped) or GGUF: a pickle-based ``.bin``/``.pt``
file can run arbitrary code when loaded, so it is refused, never opened.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import greedy_screen as screening
from . import parallel, quant, quantized_cache
from .config import AttentionType, GemmaConfig
from .errors import CheckpointError, CheckpointNotFoundError, InvalidRequestError, OutOfMemoryError
from .file_checks import (
    check_weight_dtype,
    read_generation_config,
    read_json,
    read_safetensors,
    shard_files,
)
from .model import GemmaForCausalLM, ring_size
from .quant import QUANT_BUFFERS, check_saved, quantize_model
from .tokenizer import Tokenizer

# Longest cache allocated when the caller does not ask: long enough for real use on a laptop,
# and a 32k-position model's global layers would otherwise reserve memory nobody uses.
DEFAULT_MAX_SEQ_LEN = 8192
# Sequences decoded at once when the caller does not ask. Decode on a CPU (or a small GPU
# batch) reads the weights once per step for all rows, so 4 rows cost little more than one;
# the cache grows with every row (Gemma 3 270M, fp32, 8192 positions: 81 MiB per row), and
# each batch bucket (1, 2, 4) is one more graph per kv bucket to compile. When the default
# does not fit in memory, fewer rows are allocated (down to one) rather than failing.
DEFAULT_MAX_BATCH = 4
# Buckets double from here. Below a few hundred positions attention is a sliver of a step's
# cost, while every bucket costs a compile; doubling wastes at most half of a step's cache read
# and keeps the number of graphs logarithmic (6 up to 8192).
FIRST_BUCKET = 256
# Prompts are prefilled in chunks of this many tokens, which bounds the attention scores'
# memory and how long a prompt holds back the running streams (one chunk per step); the
# prefill runs eagerly because prompt lengths vary and its matmuls are already large.
PREFILL_CHUNK = 512


_HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.model",
    "tokenizer.json",  # Gemma 4 ships no tokenizer.model
    "tokenizer_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Multimodal Gemma 3/3n/4 checkpoints nest the text model; these prefixes map back onto ours.
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
# Their image and audio towers, and the embedders that feed those into the text model, are
# skipped: the engine runs text only.
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",  # Gemma 3, 3n, 4
    "model.multi_modal_projector.",  # Gemma 3
    "model.audio_tower.",  # Gemma 3n, 4 (E2B, E4B)
    "model.embed_vision.",  # Gemma 3n, 4
    "model.embed_audio.",  # Gemma 3n, 4
)
# A KV-shared layer (Gemma 3n/4) computes no keys or values, but checkpoints still hold these;
# transformers ignores them too.
_UNUSED_BY_KV_SHARED_LAYERS = ("k_proj", "v_proj", "k_norm", "v_norm")


@dataclass
class Checkpoint:
    """What a model source resolves to: a config, weights to load, a tokenizer."""

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer_model: Path | bytes
    generation_config: dict


def resolve(model: str | os.PathLike | None) -> Path:
    """A local folder or .gguf file for ``model``: a path, a hub id, or None for the default."""
    if model is None:
        from .gguf import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file() and path.suffix in _PICKLE_SUFFIXES:
            raise CheckpointError(_pickle_refusal(path))
        if path.is_file() and path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file; pass a checkpoint folder or a .gguf file")
        return path
    text = str(model)
    looks_local = text.startswith((".", "/", "~")) or text.endswith(".gguf") or text.count("/") != 1
    if looks_local:
        raise CheckpointNotFoundError(
            f"model {text!r} not found: no such folder or file, and it is not a hub id "
            "(owner/name); check the path"
        )
    return _download(text)


def _download(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError:
        offline = constants.HF_HUB_OFFLINE
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise CheckpointNotFoundError(
            f"hub model {repo_id!r} is not in the local Hugging Face cache and {why}; "
            f"download it where the hub is reachable (hf download {repo_id}) or pass a "
            "local folder"
        ) from None
    except HfHubHTTPError as err:
        raise CheckpointNotFoundError(
            f"hub model {repo_id!r} could not be downloaded ({type(err).__name__}: "
            f"{str(err).splitlines()[0]}); check the id and your access (hf auth login)"
        ) from None


def _pickle_refusal(path: Path) -> str:
    return (
        f"{path} is a pickle checkpoint; gemma-engine loads only safetensors or GGUF, because "
        "unpickling a file can run arbitrary code. Convert it to safetensors where you trust it "
        "(transformers: model.save_pretrained(folder, safe_serialization=True))"
    )


def read_checkpoint(
    path: Path, dtype: torch.dtype, ranks: parallel.Ranks | None = None
) -> Checkpoint:
    """Read a folder (config.json + safetensors + tokenizer.model) or a .gguf file; under
    tensor parallelism (``ranks``), only this rank's slices of the text model's tensors."""
    if path.is_file() and ranks is not None:
        raise InvalidRequestError(
            f"{path} is a GGUF file, which tensor parallelism cannot read in slices (each rank "
            "would expand the whole model); convert it to a safetensors folder first "
            "(scripts/convert_gguf.py) and pass that folder"
        )
    if path.is_file():
        from .gguf import read_gguf

        gguf = read_gguf(path, dtype=dtype)
        return Checkpoint(
            gguf.config, gguf.state_dict, gguf.tokenizer_model, gguf.generation_config
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointNotFoundError(
            f"{path} has no config.json; is it a Hugging Face checkpoint?"
        )
    config = read_json(config_file)
    check_saved(config)
    tokenizer = path / "tokenizer.model"  # SentencePiece; Gemma 4 ships tokenizer.json only
    if not tokenizer.is_file():
        tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointNotFoundError(
            f"{path} has no tokenizer.model (SentencePiece) or tokenizer.json (Hugging Face)"
        )
    gen = read_generation_config(path / "generation_config.json")
    pick = None
    if ranks is not None:
        if (config.get(quant.CONFIG_KEY) or {}).get("method") == "int4":
            raise InvalidRequestError(
                "tensor parallelism cannot slice a saved int4 checkpoint (its bytes pair "
                "columns j and j + K/2); load the original weights with quantize='int4'"
            )
        read = parallel.picker(ranks, config)

        def pick(name: str, part) -> torch.Tensor | None:  # the text model's tensors only
            return None if name.startswith(_SKIPPED_PREFIXES) else read(name, part)

    return Checkpoint(config, _read_safetensors(path, dtype, pick), tokenizer, gen)


def _read_safetensors(folder: Path, dtype: torch.dtype, pick=None) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = shard_files(index, folder)
    elif (folder / "model.safetensors").is_file():
        shards = [folder / "model.safetensors"]
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(_pickle_refusal(folder / pickles[0]))
        raise CheckpointNotFoundError(
            f"{folder} has no model.safetensors or model.safetensors.index.json"
        )
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(read_safetensors(shard, pick))
    for name, tensor in tensors.items():
        if tensor.dtype.is_floating_point and not _is_quant_buffer(name, tensors):
            tensors[name] = tensor.to(dtype)
    return tensors


def _is_quant_buffer(name: str, tensors: dict[str, torch.Tensor]) -> bool:
    """A quantized weight's scale or offset, which keeps its own dtype (Gemma 4's router.scale,
    a float weight of its own, does not qualify: it has no integer .weight beside it)."""
    for suffix in QUANT_BUFFERS:
        if name.endswith(suffix):
            weight = tensors.get(name[: -len(suffix)] + ".weight")
            return weight is not None and not weight.dtype.is_floating_point
    return False


def text_state_dict(
    tensors: dict[str, torch.Tensor], config: GemmaConfig
) -> dict[str, torch.Tensor]:
    """Map the text model's tensors onto our (Hugging Face) names; drop what the text model
    does not use: vision and audio tensors, and the keys and values of KV-shared layers."""
    unused = tuple(
        f"model.layers.{i}.self_attn.{part}."
        for i, spec in enumerate(config.layers)
        if spec.kv_source != i
        for part in _UNUSED_BY_KV_SHARED_LAYERS
    )
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        for prefix, ours in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        if unused and name.startswith(unused):
            continue
        out[name] = tensor
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # a tied head is the embedding; some exports repeat it
    return out


def build_model(
    config: GemmaConfig,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    quantized: tuple[str, int | None] | None = None,
    shard: parallel.Shard | None = None,
) -> GemmaForCausalLM:
    """Build on the meta device and assign the checkpoint's tensors: no second copy.

    ``quantized`` (method, group size) describes a checkpoint saved already quantized;
    ``shard``, the part of the model this rank holds under tensor parallelism.
    """
    with torch.device("meta"):
        model = GemmaForCausalLM(config) if shard is None else shard.build(config)
        if quantized is not None:
            quantize_model(model, *quantized, dtype)
    state = text_state_dict(tensors, config)
    metas = model.state_dict()
    expected = {name: p.shape for name, p in metas.items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s): "
            f"{', '.join(missing[:5])}; is it complete and a Gemma text model?"
        )
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): "
            f"{', '.join(unexpected[:5])}; does config.json match the weights?"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(state[name].shape)}, "
                f"but config.json implies {tuple(shape)}"
            )
        want = metas[name].dtype
        check_weight_dtype(name, state[name], want)
        if not want.is_floating_point and state[name].dtype != want:  # quantized weights
            raise CheckpointError(
                f"tensor {name} is {state[name].dtype} but a quantized checkpoint stores "
                f"{want}; save it again with this version of gemma-engine"
            )
    state = {name: t.to(device) for name, t in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def build_from_cache(
    kept: quantized_cache.Entry | None,
    config: GemmaConfig,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    quantized: tuple[str, int | None],
) -> GemmaForCausalLM | None:
    """The model with its quantized tensors from the cache entry ``kept`` in place of the
    checkpoint's float ones (never read then), or None when there is no usable entry."""
    found = kept.read() if kept is not None else None
    if found is None:
        return None
    state = text_state_dict(tensors, config)
    state.update(found)
    try:
        return build_model(config, state, device, dtype, quantized)
    except CheckpointError as err:  # not this model's quantized tensors
        kept.warn(f"does not fit this model ({err})")
        return None


# -- everything from_pretrained does before the engine exists ------------------------------
@dataclass
class Loaded:
    """A model ready to run: weights placed (quantized if asked), cache allocated."""

    model: GemmaForCausalLM
    tokenizer: Tokenizer
    eos_token_ids: set[int]
    buckets: list[int]
    max_batch: int
    prefill_chunk: int
    quantization: tuple[str, int | None] | None  # (method, group size)
    source: Checkpoint  # config and tokenizer (its tensors dropped), for save_pretrained
    path: Path  # the folder or .gguf file it was read from


def load(
    model: str | os.PathLike | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int | None,
    buckets: list[int] | None,
    quantize: str | None,
    group_size: int | None,
    max_batch: int | None,
    prefill_chunk: int | None,
    ranks: parallel.Ranks | None = None,
    compiled: bool = True,
    greedy_screen: bool | None = None,
    kv_dtype: torch.dtype | None = None,
) -> Loaded:
    """Resolve, read, configure, check, quantize and build: the steps of
    ``Engine.from_pretrained``, every check done before the weights are placed.

    Under tensor parallelism (``ranks``) each rank reads and builds its part of the model, and
    an error on one rank ends every rank's load with that rank's message (parallel.py).
    ``greedy_screen``: whether greedy steps read an int8 copy of a float output layer
    (greedy_screen.py); None, where it is measured to pay off. ``kv_dtype``: the KV cache's
    dtype (default ``dtype``).
    """
    with ranks.together() if ranks is not None else contextlib.nullcontext():
        path = resolve(model)
        ckpt = read_checkpoint(path, dtype, ranks)
        config = GemmaConfig.from_hf(ckpt.config)
        shard = ranks.shard(config) if ranks is not None else None
        with torch.device("meta"):  # the layers quantization would replace, with no weights
            skeleton = GemmaForCausalLM(config)
            widths = quant.input_widths(skeleton)
            if shard is not None:  # a rank's narrower layers must fit int8 words, int4 groups
                widths = sorted({*widths, *quant.input_widths(shard.build(config))})
        method, group_size = quant.check_quantize(quantize, group_size, widths)
        quant.check_supported(skeleton, method)
        saved = ckpt.config.get(quant.CONFIG_KEY)
        if saved and method not in ("none", saved["method"]):
            raise InvalidRequestError(
                f"this checkpoint is already quantized ({saved['method']}); load it without "
                "quantize, or quantize from the original weights"
            )
        max_seq_len = _check_max_seq_len(max_seq_len, config)
        buckets = _check_buckets(buckets, max_seq_len)
        chunk = _check_whole(
            "prefill_chunk", PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        )
        kv_dtype = kv_dtype or dtype
        max_batch = _fit_max_batch(max_batch, config, max_seq_len, chunk, kv_dtype, device)
        tokenizer = Tokenizer(ckpt.tokenizer_model)
        tokenizer.check_fits(config.vocab_size)
        quantized = (saved["method"], saved.get("group_size")) if saved else None
        float_head = dtype if method == "none" and not saved else None  # its weights' dtype
        sharded = shard is not None
        if greedy_screen and (
            why := screening.possible(
                skeleton.output_layer(), float_head, device, compiled, sharded
            )
        ):
            raise InvalidRequestError(f"greedy_screen: {why}; leave greedy_screen unset")
        # A CPU process keeps what it quantizes for the next one (quantized_cache.py).
        kept = None
        if not saved and method != "none" and shard is None and device.type == "cpu":
            kept = quantized_cache.Entry(path, method, group_size, dtype)
        net = build_from_cache(kept, config, ckpt.tensors, device, dtype, (method, group_size))
        if net is not None:
            quantized, kept = (method, group_size), None
        else:
            net = build_model(config, ckpt.tensors, device, dtype, quantized, shard)
    if ranks is not None:  # the same batch buckets, hence the same steps, on every rank
        max_batch = ranks.smallest(max_batch)
    if quantized is None and method != "none":  # after the ranks agree: int8 scales are
        row_max = shard.row_max if shard is not None else None  # collective
        quant.quantize_model(net, method, group_size, dtype, row_max=row_max)
        quantized = (method, group_size)
        if kept is not None:
            kept.write(quantized_cache.quantized_tensors(net))
    del ckpt.tensors  # the model holds what it needs
    if quantized is not None:
        if device.type == "cpu":
            # The int8 output layer's packed copy (packed_int8.py) serves products of several
            # rows (batched steps) and eager ones. Building it is not free: fbgemm's prepack of
            # the default model's output layer took 3.6 s of a 7.9 s cold start on an AMD EPYC
            # Zen 3 (2026-12-07, BENCHMARKS.md). A compiled engine of one sequence goes
            # without: its prompts' logits come from a compiled graph (Engine.head), and a
            # speculative step's few rows from the one-token kernel per row.
            several = max_batch > 1 or not compiled
            quant.to_kernel_layout(net, net.output_layer() if several else None)
        quant.warn_if_slow(quantized[0], device)
    if shard is not None:
        shard.attach(net)
        shard.notice()
    if greedy_screen is None:
        greedy_screen = quantized is None and screening.wanted(net, device, compiled)
    if greedy_screen:
        screening.attach(net, path)
    net.setup_cache(max_seq_len, max_batch, chunk, kv_dtype)
    eos = set(config.eos_token_ids)
    gen_eos = ckpt.generation_config.get("eos_token_id")
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    for end in ("<end_of_turn>", "<turn|>"):  # a finished turn ends the text, as in HF
        if tokenizer.has_piece(end):
            eos.add(tokenizer.special_id(end))
    return Loaded(net, tokenizer, eos, buckets, max_batch, chunk, quantized, ckpt, path)


def default_buckets(max_seq_len: int) -> list[int]:
    buckets, n = [], FIRST_BUCKET
    while n < max_seq_len:
        buckets.append(n)
        n *= 2
    return [*buckets, max_seq_len]


def _check_whole(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def _check_max_seq_len(max_seq_len: int | None, config: GemmaConfig) -> int:
    limit = config.max_position_embeddings
    if max_seq_len is None:
        return min(limit, DEFAULT_MAX_SEQ_LEN)
    if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= limit:
        raise InvalidRequestError(
            f"max_seq_len must be a whole number from 1 to {limit} (the "
            f"model's max_position_embeddings), got {max_seq_len!r}"
        )
    return max_seq_len


def _check_buckets(buckets: list[int] | None, max_seq_len: int) -> list[int]:
    if buckets is None:
        return default_buckets(max_seq_len)
    if not buckets or not all(isinstance(b, int) and 1 <= b <= max_seq_len for b in buckets):
        raise InvalidRequestError(
            f"buckets must be whole numbers from 1 to max_seq_len ({max_seq_len}), got {buckets!r}"
        )
    return sorted(set(buckets) | {max_seq_len})


def cache_bytes(config: GemmaConfig, max_seq_len: int, chunk: int, dtype: torch.dtype) -> int:
    """Bytes of one cache row (one sequence): every cache-owning layer's keys and values."""
    ring = ring_size(config, max_seq_len, chunk)
    need = 0
    for i, (spec, kind) in enumerate(zip(config.layers, config.layer_types, strict=True)):
        if spec.kv_source != i:  # a KV-shared layer reads another layer's cache
            continue
        slots = ring if kind is AttentionType.SLIDING else max_seq_len
        need += 2 * slots * spec.num_key_value_heads * spec.head_dim * dtype.itemsize
    return need


def _fit_max_batch(
    max_batch: int | None,
    config: GemmaConfig,
    max_seq_len: int,
    chunk: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """The rows to allocate, checked against free memory before anything is: ``max_batch``
    if given, else DEFAULT_MAX_BATCH halved until it fits (the cache must fit at one row)."""
    row = cache_bytes(config, max_seq_len, chunk, dtype)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if max_batch is not None:
        batch = _check_whole("max_batch", max_batch)
    else:
        batch = DEFAULT_MAX_BATCH
        while batch > 1 and batch * row > 0.8 * free:
            batch //= 2
    if batch * row > 0.8 * free:
        rows = f"{batch} sequences of " if batch > 1 else ""
        raise OutOfMemoryError(
            f"a KV cache of {rows}{max_seq_len} positions needs {batch * row / 2**30:.1f} GiB but "
            f"only {free / 2**30:.1f} GiB is free on {device}; pass a smaller max_seq_len "
            "(--max-seq-len)" + (" or max_batch (--max-batch)" if batch > 1 else "")
        )
    return batch
