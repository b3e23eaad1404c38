"""The CPU decode kernels of quantized matrices, and the layout they read.

quant.py quantizes and saves matrices in a plain layout: int8 rows (N, K), and for int4 two
nibbles per byte, (N, K/2). The *kernel* layout, made once at load, packs the quantized values
into int32 words and blocks the rows by the vector width ``L`` of the CPU's capability (8 for
AVX2, 16 for AVX-512): a weight matrix becomes words (N/L, K/4, L) for int8 (word c of row n
holds columns 4c..4c+3) or (N/L, K/8, L) for int4 (eight nibbles). Why: inductor vectorizes a
reduction over int8 bytes with as many lanes as a float vector has, so each step loads 8 bytes
into a 32-byte AVX2 register, which ATen's ``Vectorized<int8_t>::loadu`` does through a
temporary buffer and a store-forwarding stall (AVX-512 has masked loads instead): 4-15x slower
than fp32 on AVX2 (BENCHMARKS.md). A full int32 load, bytes taken apart with native 32-bit
shifts, and one activation broadcast against L output rows, vectorizes on both kinds, with no
horizontal sums per row. Under AVX-512 the int8 blocks keep plain bytes, (N/L, K, L): 16 bytes
are one masked load there, widened by one instruction, fewer than the shifts that take a word
apart (``int8_words``).

A decode step on a CPU runs these products inside its compiled graph, one token (``matvec_*``)
or a few rows of a batch or a verify step (``matvec_int8_rows``); a prompt of many tokens
expands each weight once per call and runs a dense matmul instead (quant.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu


def int8_words() -> bool:
    """Whether this capability's int8 kernel layout packs four bytes per int32 word.

    AVX-512 loads 16 int8 bytes with a masked load and widens them with one instruction
    (vpmovsxbd), so there the blocks keep plain bytes: a decode step's layer products ran
    1.2 ms faster than with words (21.0 -> 19.8 ms, BENCHMARKS.md). Under AVX2 a load of 8
    bytes goes through a temporary buffer (see the top), 3-4x slower than words.
    """
    return cpu.capability() != "AVX512"


def block_int8(q: Tensor, lanes: int, words: bool = True) -> Tensor:
    """int8 (N, K) -> the kernel layout (ceil(N/L), K', L), padded rows 0: int32 words
    (K' = K/4, bytes in memory order) or, with ``words=False``, the int8 bytes (K' = K)."""
    n, k = q.shape
    if n % lanes:  # (a copy, which the default model's matrices do not need)
        q = F.pad(q, (0, 0, 0, -n % lanes))
    q = q.contiguous()  # (N', K)
    if words:
        q = q.view(torch.int32)  # (N', K/4)
    return q.view(-1, lanes, q.shape[1]).transpose(1, 2).contiguous()


def unblock_int8(blocks: Tensor, n: int) -> Tensor:
    """The inverse of ``block_int8``: int8 (N, K)."""
    nb, kw, lanes = blocks.shape
    rows = blocks.transpose(1, 2).reshape(nb * lanes, kw)[:n]
    return rows.contiguous().view(torch.int8)


TOP_BYTE = -(1 << 24)  # 0xFF000000 as an int32
WORD_UNSCALE = 2.0**-24  # _top_byte's factor, taken out once per output


def _top_byte(words: Tensor, j: int) -> Tensor:
    """Byte j of each int32 word (little-endian) moved to the word's top byte, zeros below:
    the signed byte times 2**24, exactly, and exactly so as a float (8 significant bits).

    Three shifts and three ANDs per word, where shifting each byte down to a sign-extended
    int took seven shifts. The products x * (b * 2**24) are those of x * b scaled by a power of
    two, so once the sum is multiplied by 2**-24 every output is bit for bit what the
    shifted-down bytes gave. The output layer's kernel under AVX2 went 5.2-5.4 -> 4.3-5.0 ms
    on an AMD EPYC (BENCHMARKS.md). On Intel CPUs an AND may also run on a vector port that
    shifts cannot use.
    """
    if j == 0:
        return words << 24
    if j == 3:
        return words & TOP_BYTE
    return (words << (24 - 8 * j)) & TOP_BYTE


STREAMS = 4  # row groups of the matrix that one product's loop reads side by side


def matvec_int8(x: Tensor, blocks: Tensor, scale: Tensor, streams: int = STREAMS) -> Tensor:
    """x (..., K) @ W.T for one token, W in the kernel layout: one pass over the blocks.

    For each column the activation is broadcast against L rows at once, so the reduction
    runs down the columns with no horizontal sums. Words hold four columns: activations
    x[4c + j] meet byte j of word c.

    The blocks are read as ``streams`` groups of rows, each its own reduction over the same
    columns of the same activations: inductor fuses such reductions into one loop (as it
    fuses a layer's gate and up products), which then reads the groups side by side. One
    stream of bytes per thread left the hardware prefetchers behind: the layers' products of
    a step read 4.8 GB/s under AVX2 with one group, 8.4-9.0 with four, and 14.2 -> 15.9 GB/s
    under AVX-512 (BENCHMARKS.md). Each output's sum is the same either way.
    """
    nb, kw, lanes = blocks.shape
    groups = streams if nb % streams == 0 else 1
    acc = torch.cat([_block_sums(x, b) for b in blocks.chunk(groups)])  # (nb, L)
    n = scale.shape[0]
    if blocks.dtype == torch.int32:
        scale = scale * WORD_UNSCALE  # exact: a power of two
    out = acc.reshape(nb * lanes)[:n] * scale
    return out.to(x.dtype).view(*x.shape[:-1], n)


def matvec_int8_rows(x: Tensor, blocks: Tensor, scale: Tensor) -> Tensor:
    """x (R, K) @ W.T, a few rows (a batched decode step, a verify step), in one pass over
    the blocks: one ``matvec_int8`` per row, which inductor fuses into one loop.

    With more than two rows each row reads the matrix as one group of rows, not
    ``STREAMS``: the fused loop then has enough loads in flight, and fewer reductions to
    carry (past 16, inductor's ``cpp.max_horizontal_fusion_size``, it splits the loop and
    reads the words again). The 262,144 x 640 output layer under AVX2 on an AMD EPYC Zen 3,
    compiled alone (2026-12-07), one group per row against four: 16.5 against 19.6 ms for 4
    rows, 19.6 against 22.6 for 5, 29.6 against 38.0 for 8; for 2 rows 11.4 against 10.9, for
    one 10.0 against 7.3. Each output's sum is the same either way.
    """
    streams = STREAMS if x.shape[0] <= 2 else 1
    return torch.stack([matvec_int8(row, blocks, scale, streams) for row in x])


def _block_sums(x: Tensor, blocks: Tensor) -> Tensor:
    """(nb, L): sum over the columns of x times each block's rows, one accumulator per
    block (the four bytes of a word are summed before they meet it: fewer registers). Words
    give the sums times 2**24 (``_top_byte``)."""
    kw = blocks.shape[1]
    if blocks.dtype == torch.int8:
        return (x.reshape(kw, 1).float() * blocks.float()).sum(1)
    x4 = x.reshape(kw, 4).float()
    terms = [x4[:, j, None] * _top_byte(blocks, j).float() for j in range(4)]
    return ((terms[0] + terms[1]) + (terms[2] + terms[3])).sum(1)


# -- int4 ----------------------------------------------------------------------------------
def block_int4(
    packed: Tensor, scale: Tensor, offset: Tensor, lanes: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Saved int4 -> kernel layout: words (N'/L, K/8, L), nibble j of word c = column 8c + j;
    scales and offsets (N'/L, K/G, L)."""
    n, half = packed.shape
    levels = torch.cat((packed & 15, packed >> 4), dim=1).to(torch.int32)  # (N, K)
    levels = levels.view(n, -1, 8)
    words = levels[..., 0].clone()
    for j in range(1, 8):
        words |= levels[..., j] << (4 * j)
    pad = -n % lanes

    def block(t: Tensor) -> Tensor:  # (N, C) -> (N'/L, C, L)
        return F.pad(t, (0, 0, 0, pad)).view(-1, lanes, t.shape[1]).transpose(1, 2).contiguous()

    return block(words), block(scale), block(offset)


def unblock_int4(
    words: Tensor, scale: Tensor, offset: Tensor, n: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of ``block_int4``: the saved (packed, scale, offset)."""

    def rows(t: Tensor) -> Tensor:  # (N'/L, C, L) -> (N, C)
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:n].contiguous()

    w = rows(words)
    levels = torch.stack([(w >> (4 * j)) & 15 for j in range(8)], dim=-1).view(n, -1)
    half = levels.shape[1] // 2
    packed = (levels[:, :half] | (levels[:, half:] << 4)).to(torch.uint8)
    return packed, rows(scale), rows(offset)


def matvec_int4(x: Tensor, words: Tensor, scale: Tensor, offset: Tensor, n: int) -> Tensor:
    """x (..., K) @ W.T for one token, W in the int4 kernel layout.

    Per group g, sum_k x_k (q_k s_g + o_g) = s_g * sum_k x_k q_k + o_g * sum_k x_k: the inner
    loop only widens nibbles and multiplies, and scales apply once per group. Nibbles come
    out of int32 words (native shifts; AVX2 shifts bytes only by emulation).
    """
    nb, kw, lanes = words.shape
    groups = scale.shape[1]
    per = kw // groups  # words per group
    x8 = x.reshape(groups, per, 8).float()
    w = words.view(nb, groups, per, lanes)
    dot = sum(
        (x8[None, :, :, j, None] * ((w >> (4 * j)) & 15).float()).sum(2) for j in range(8)
    )  # (nb, groups, L)
    xsum = x8.sum((1, 2))[None, :, None]  # (1, groups, 1)
    out = (scale.float() * dot + offset.float() * xsum).sum(1)  # (nb, L)
    return out.reshape(nb * lanes)[:n].to(x.dtype).view(*x.shape[:-1], n)
