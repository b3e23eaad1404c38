"""Tensor parallelism over torch.distributed: each rank runs a narrower Gemma.

Megatron's layout, with PyTorch's functional collectives (which ``torch.compile`` traces into
the decode graph, ``fullgraph=True``): rank r of W holds

- query heads ``[r H/W, (r+1) H/W)`` of q_proj, and the key/value heads those queries read (KV
  heads ``[r KV/W, ...)``; with fewer KV heads than ranks, MQA, each rank keeps a copy of the
  one its queries use), so its KV cache holds its heads only;
- columns ``[r I/W, (r+1) I/W)`` of gate_proj and up_proj;
- the matching input columns of o_proj and down_proj, whose outputs are partial sums: one
  all-reduce after each (a forward hook, so that model.py stays one model);
- rows ``[r V', (r+1) V')`` of the embedding (V' = V/W rounded up; the last slice is padded
  with zero rows): a lookup reads the rank's rows, zeros elsewhere, and an all-reduce adds
  them up; the tied output layer gives the rank's logits, and an all-gather the whole row;
- the norms, which are small, whole.

Rank r's layers are those of a model with H/W heads, KV/W KV heads and I/W MLP columns
(``Shard.local_config``); each rank reads only its slices from the memory-mapped safetensors
(``Shard.read``). Only Gemma 1, 2 and 3 shard (3n and 4 have layers of other kinds).

Why functional collectives on plain tensors rather than DTensor's ``parallelize_module``: each
rank's weights are ordinary (smaller) tensors, so the engine's own products (the fused
multiply-reduce decode kernels, the quantized int32-word layouts of quant.py) run unchanged, and
the communication is three explicit points a layer, which the compiled graph holds as ops.

Every rank must make the same calls in the same order (SPMD): ``torchrun`` starts the same
program W times. Sampled tokens are broadcast from rank 0, so that the ranks never diverge
(seeded generators agree anyway; unseeded ones would not).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from .config import GemmaConfig
from .errors import GemmaEngineError, InvalidRequestError, UnsupportedModelError
from .layers import Embedding, Linear, lookup
from .model import GemmaForCausalLM

# A backstop for a rank that is gone or stuck: the other ranks' next collective fails after
# this long instead of waiting forever. Compiling a decode graph on a busy CPU can take
# minutes, during which the other ranks wait in their first collective.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
SHARDED_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
# Bytes of an error message that ranks exchange when one fails to load.
_MESSAGE_BYTES = 2048

# Tensors that are sliced, by the end of their name (multimodal checkpoints add a prefix);
# everything else (norms) is whole on every rank.
_SLICED = re.compile(
    r"(?:\.self_attn\.(?P<attn>[qkvo])_proj|\.mlp\.(?P<mlp>gate|up|down)_proj"
    r"|(?P<vocab>embed_tokens|lm_head))\.(?P<part>weight|scale)$"
)


class ParallelError(GemmaEngineError, RuntimeError):
    """A rank failed (to load, say) while the others did not; every rank raises this."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the group: rank ``rank`` of ``world``."""

    rank: int
    world: int
    group_name: str  # the process group, as functional collectives name it
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def shard(self, config: GemmaConfig) -> Shard:
        """What this rank holds of a model of ``config``; a specific error if it cannot split."""
        if config.model_type not in SHARDED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"tensor parallelism covers Gemma 1, 2 and 3; this is a {config.model_type} "
                "(run it in one process)"
            )
        w = self.world
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        sizes = {
            "num_attention_heads": heads,
            "intermediate_size": config.intermediate_size,
        }
        for name, value in sizes.items():
            if value % w:
                raise InvalidRequestError(
                    f"tensor parallelism over {w} ranks needs {name} ({value}) to be a "
                    f"multiple of {w}; run with a number of processes that divides it "
                    f"({', '.join(str(n) for n in range(1, value + 1) if value % n == 0)})"
                )
        if kv % w and w % kv:
            raise InvalidRequestError(
                f"tensor parallelism over {w} ranks needs num_key_value_heads ({kv}) to be a "
                f"multiple or a divisor of {w}, so that each rank's query heads read whole "
                "key/value heads"
            )
        local_heads = heads // w
        group = heads // kv  # query heads per KV head
        return Shard(
            ranks=self,
            heads=local_heads,
            kv_heads=max(kv // w, 1),
            kv_start=self.rank * local_heads // group,
            intermediate=config.intermediate_size // w,
            head_dim=config.head_dim,
            vocab=-(-config.vocab_size // w),
            vocab_size=config.vocab_size,
            replicated_kv=kv < w,
        )

    def agree(self, error: BaseException | None) -> None:
        """Every rank calls this at the same point, with the error it met or None; if any
        rank has one, every rank raises: its own error when all ranks met the same one,
        else a ParallelError naming the first failing rank and its message."""
        message = b""
        if error is not None:
            message = f"{type(error).__name__}: {error}".encode()[: _MESSAGE_BYTES - 1]
        device = _collective_device(self.group)
        mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        mine[0] = error is not None
        mine[1 : 1 + len(message)] = torch.tensor(list(message), dtype=torch.uint8)
        everyone = torch.empty(self.world * _MESSAGE_BYTES, dtype=torch.uint8, device=device)
        dist.all_gather_single(everyone, mine.to(device), group=self.group)
        rows = everyone.view(self.world, _MESSAGE_BYTES).cpu()
        failed = [r for r in range(self.world) if rows[r, 0]]
        if not failed:
            return
        texts = [bytes(rows[r, 1:].tolist()).rstrip(b"\0").decode(errors="replace") for r in failed]
        if error is not None and len(failed) == self.world and len(set(texts)) == 1:
            raise error  # the same on every rank (a bad path, say): say it as one process would
        first = failed[0]
        others = f" (and rank {', '.join(map(str, failed[1:]))})" if failed[1:] else ""
        raise ParallelError(f"rank {first} of {self.world} failed{others}: {texts[0]}") from error

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value``: a choice the ranks must share (the cache
        rows each fits in the memory it sees, say)."""
        t = torch.tensor([value], device=_collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Run a block on every rank and leave it together: if it raises on one rank, it
        raises on all (see ``agree``), so that no rank waits for another in a collective.
        The block itself must not run collectives."""
        try:
            yield
        except Exception as err:
            self.agree(err)
            raise
        self.agree(None)


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def setup(device: torch.device) -> tuple[Ranks | None, torch.device]:
    """This process's ranks and device: None and ``device`` outside a multi-process group.

    A process group already set up (``dist.init_process_group``) is used as it is; otherwise
    torchrun's environment (WORLD_SIZE > 1) starts one, gloo on CPU and NCCL on CUDA, where
    each rank takes ``cuda:LOCAL_RANK`` unless a device index was given.
    """
    if not dist.is_available():
        return None, device
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None, device
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise InvalidRequestError(
                f"WORLD_SIZE is {world} but {', '.join(missing)} is not set; launch with "
                "torchrun --nproc-per-node N, which sets them all"
            )
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if device.index >= torch.cuda.device_count():
                raise InvalidRequestError(
                    f"rank {os.environ['RANK']} would run on {device}, but this machine has "
                    f"{torch.cuda.device_count()} GPU(s); start at most that many processes "
                    "per node (torchrun --nproc-per-node)"
                )
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    if dist.get_world_size() <= 1:
        return None, device
    group = dist.group.WORLD
    return Ranks(dist.get_rank(), dist.get_world_size(), group.group_name, group), device


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 outside torchrun), before any group exists."""
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Shard:
    """One rank's part of a model (see the top): sizes, slices, and the collectives."""

    ranks: Ranks
    heads: int  # query heads of this rank
    kv_heads: int  # key/value heads it holds
    kv_start: int  # the first of them
    intermediate: int  # MLP columns it holds
    head_dim: int
    vocab: int  # embedding rows it holds (the last rank's padded with zeros)
    vocab_size: int
    replicated_kv: bool  # fewer KV heads than ranks: each rank holds a copy of its one

    @property
    def vocab_start(self) -> int:
        return self.ranks.rank * self.vocab

    def local_config(self, config: GemmaConfig) -> GemmaConfig:
        """The config of this rank's layers: a Gemma with its share of heads and columns
        (the vocabulary stays whole here; the embedding is sliced by ``build``)."""
        layers = tuple(
            replace(s, num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate)
            for s in config.layers
        )
        return replace(
            config,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            layers=layers,
        )

    def build(self, config: GemmaConfig) -> GemmaForCausalLM:
        """This rank's model (on the current device, meta to load into): layers of the local
        config and the rank's rows of the embedding; ``config`` stays the model's own."""
        model = GemmaForCausalLM(self.local_config(config))
        model.config = model.model.config = config
        model.model.embed_tokens = Embedding(self.vocab, config.hidden_size)
        if not config.tie_word_embeddings:
            model.lm_head = Linear(config.hidden_size, self.vocab, bias=False)
        return model

    def notice(self) -> None:
        """Say on rank 0 (stderr) when the KV heads are copied rather than split."""
        if self.replicated_kv and self.ranks.rank == 0:
            print(
                f"gemma-engine: fewer key/value heads than the {self.ranks.world} ranks; each "
                "rank keeps a copy of the key/value head its query heads read (its KV cache "
                "is replicated, not split)",
                file=sys.stderr,
                flush=True,
            )

    # -- loading -----------------------------------------------------------------------------
    def read(self, name: str, part) -> Tensor:
        """This rank's slice of the checkpoint tensor ``name``; ``part`` is safetensors'
        lazy slice of it. Rows come back as views of the memory-mapped file, so a rank's
        memory holds only the pages of its own rows."""
        m = _SLICED.search(name)
        if m is None:
            return part[:]
        r = self.ranks.rank
        if m["vocab"]:
            stop = min(self.vocab_start + self.vocab, self.vocab_size)
            rows = part[self.vocab_start : stop]
            pad = self.vocab - rows.shape[0]  # the last rank's rows past the vocabulary
            if not pad:
                return rows
            if rows.dim() == 1:  # a saved int8 scale: padded rows are zeros times one
                return F.pad(rows, (0, pad), value=1.0)
            return F.pad(rows, (0, 0, 0, pad))
        if m["attn"] == "o" or m["mlp"] == "down":  # split by input: columns
            if m["part"] == "scale":  # per output row, whole on every rank
                return part[:]
            width = self.heads * self.head_dim if m["attn"] else self.intermediate
            # A copy: a view of these columns would keep every page of the whole matrix in use.
            return part[:, r * width : (r + 1) * width].contiguous()
        if m["attn"] == "q":
            width = self.heads * self.head_dim
            return part[r * width : (r + 1) * width]
        if m["attn"]:  # k, v
            start = self.kv_start * self.head_dim
            return part[start : start + self.kv_heads * self.head_dim]
        return part[r * self.intermediate : (r + 1) * self.intermediate]  # gate, up

    def row_max(self, name: str, amax: Tensor) -> Tensor:
        """A weight's per-row absolute maxima over every rank's columns, for int8 scales equal
        to one process's: o_proj's and down_proj's rows are split across ranks."""
        if name in ("o_proj", "down_proj"):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.ranks.group)
        return amax

    def attach(self, model: nn.Module) -> None:
        """Give the model its collectives: the model's ``tp``, and an all-reduce after each
        o_proj and down_proj (after quantization, which replaces those modules)."""
        model.tp = self
        for layer in model.model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.register_forward_hook(self._reduce_output)

    # -- running -----------------------------------------------------------------------------
    def _reduce_output(self, module: nn.Module, args: object, out: Tensor) -> Tensor:
        return self.reduce(out)

    def reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's partial ``x``."""
        return funcol.all_reduce(x, "sum", self.ranks.group_name)

    def embed(self, table: nn.Module, tokens: Tensor) -> Tensor:
        """Embedding rows of ``tokens`` (..., hidden): each rank looks up the ids in its
        slice, zeros for the rest, and the sum is the row (x + 0 is exact)."""
        local = tokens - self.vocab_start
        mine = (local >= 0) & (local < self.vocab)
        rows = lookup(table, torch.where(mine, local, 0))
        return self.reduce(torch.where(mine[..., None], rows, 0))

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """Every rank's logits (..., V') -> the whole vocabulary (..., V), on every rank."""
        whole = funcol.all_gather_single(
            logits.contiguous(), logits.dim() - 1, self.ranks.group_name
        )
        return whole[..., : self.vocab_size]

    def broadcast(self, tokens: Tensor) -> Tensor:
        """Rank 0's ``tokens`` on every rank (in place)."""
        dist.broadcast(
            tokens, src=dist.get_global_rank(self.ranks.group, 0), group=self.ranks.group
        )
        return tokens


def picker(ranks: Ranks, config: dict) -> Callable[[str, object], Tensor]:
    """A reader of this rank's slice of each tensor of a checkpoint with ``config``."""
    return ranks.shard(GemmaConfig.from_hf(config)).read
