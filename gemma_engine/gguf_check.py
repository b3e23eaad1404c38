"""A bounded walk of a GGUF file's header, before the ``gguf`` package ever reads it.

``gguf.GGUFReader`` trusts the counts and lengths a file declares: an array that claims 2^63
elements makes it loop forever (llama.cpp PR #27188; gguf 0.19.0 on PyPI is affected). Model
files come from strangers, so every count and length is checked here against the bytes left in
the file *before* anything is read, looped over or allocated, mirroring the checks of
llama.cpp's own parser (``ggml/src/gguf.cpp``): magic and version; tensor and metadata counts;
string and array lengths; known value types and no arrays of arrays; keys non-empty, unique and
UTF-8; ``general.alignment`` a UINT32 power of two; per tensor a unique name shorter than 64
bytes, 1 to 4 dimensions whose product fits in 63 bits, a known ggml type whose block divides
the first dimension, and data that is aligned, in order, not overlapping and inside the file.

A failure is a :class:`CheckpointError` naming the field and its byte offset. The walk reads
the header once (an mmap, no copy) and costs a fraction of a second for a 262k-token vocabulary.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 used 32-bit counts and is gone from llama.cpp too
# llama.cpp's GGUF_MAX_STRING_LENGTH and GGUF_MAX_ARRAY_ELEMENTS; the bytes left in the file
# bound every length far more tightly in practice.
MAX_STRING_BYTES = 1 << 30
MAX_ARRAY_ELEMENTS = 1 << 30
# Real Gemma files hold ~40 keys and ~300-900 tensors; these leave room without letting a
# count drive a long loop.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 63  # llama.cpp's GGML_MAX_NAME is 64, with the terminating NUL
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_INT63 = (1 << 63) - 1

# GGUF value types: id -> (name, size in bytes; None for STRING and ARRAY).
VALUE_TYPES = {
    0: ("UINT8", 1),
    1: ("INT8", 1),
    2: ("UINT16", 2),
    3: ("INT16", 2),
    4: ("UINT32", 4),
    5: ("INT32", 4),
    6: ("FLOAT32", 4),
    7: ("BOOL", 1),
    8: ("STRING", None),
    9: ("ARRAY", None),
    10: ("UINT64", 8),
    11: ("INT64", 8),
    12: ("FLOAT64", 8),
}
STRING, ARRAY, UINT32 = 8, 9, 4


@dataclass(frozen=True)
class GGUFLayout:
    """What the walk found: enough for the loader to trust the file's structure."""

    version: int
    n_kv: int
    n_tensors: int
    alignment: int
    data_start: int  # where tensor data begins (aligned)
    data_end: int  # the end of the last tensor's data


class _Walker:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, what: str, offset: int | None = None) -> CheckpointError:
        at = self.pos if offset is None else offset
        return CheckpointError(
            f"{self.path} is truncated or corrupted: {what} (at byte {at:,} of {self.size:,}). "
            "Download it again, from a source you trust."
        )

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n:,} bytes but only {self.size - self.pos:,} are left")

    def unpack(self, fmt: str, what: str) -> int | float:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return int(self.unpack("<I", what))

    def u64(self, what: str) -> int:
        return int(self.unpack("<Q", what))

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> bytes:
        start = self.pos
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} declares {n:,} bytes, over the limit of {limit:,}", start)
        self.need(n, what)
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return data

    def text(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        start = self.pos
        data = self.string(what, limit)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.fail(
                f"{what} is not UTF-8 ({err.reason} at byte {err.start})", start
            ) from None

    def strings(self, count: int, what: str) -> None:
        """Steps over ``count`` strings (a vocabulary: the hot loop, so inlined)."""
        buf, size, pos = self.buf, self.size, self.pos
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                raise self.fail(f"element {i} of {what} is cut off")
            (n,) = struct.unpack_from("<Q", buf, pos)
            if n > size - pos - 8:
                self.pos = pos
                raise self.fail(f"element {i} of {what} declares {n:,} bytes, past the end")
            try:
                str(buf[pos + 8 : pos + 8 + n], "utf-8")
            except UnicodeDecodeError as err:
                self.pos = pos
                raise self.fail(f"element {i} of {what} is not UTF-8 ({err.reason})") from None
            pos += 8 + n
        self.pos = pos

    def value_type(self, what: str) -> int:
        start = self.pos
        kind = self.u32(f"the type of {what}")
        if kind not in VALUE_TYPES:
            raise self.fail(f"{what} has unknown value type {kind}", start)
        return kind

    def skip_value(self, kind: int, what: str) -> int | None:
        """Steps over one value; returns it if it is a UINT32 (general.alignment needs it)."""
        if kind == STRING:
            self.text(what)
            return None
        if kind == ARRAY:
            start = self.pos
            item = self.value_type(f"the elements of {what}")
            if item == ARRAY:
                raise self.fail(f"{what} is an array of arrays, which GGUF readers refuse", start)
            count = self.u64(f"the length of {what}")
            if count > MAX_ARRAY_ELEMENTS:
                raise self.fail(f"{what} declares {count:,} elements, over the limit", start)
            # Each element takes at least its fixed size, or a string's 8-byte length.
            width = VALUE_TYPES[item][1] or 8
            self.need(count * width, f"the {count:,} elements of {what}")
            if item == STRING:
                self.strings(count, what)
            else:
                self.pos += count * width
            return None
        name, width = VALUE_TYPES[kind]
        if kind == UINT32:
            return self.u32(what)
        self.need(width, f"{what} ({name})")
        self.pos += width
        return None


def check_gguf(path: str | Path) -> GGUFLayout:
    """Walks the header of the GGUF file ``path``; raises CheckpointError at the first problem."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise CheckpointError(f"{path} is empty; it is not a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    return _walk(_Walker(view, path))
                finally:
                    view.release()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None


def _walk(w: _Walker) -> GGUFLayout:
    import gguf  # the ggml type table is the gguf package's, kept up to date with llama.cpp

    magic = bytes(w.buf[:4])
    if magic != MAGIC:
        raise w.fail(f"it starts with {magic!r}, not {MAGIC!r}", 0)
    w.pos = 4
    version = w.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise w.fail(f"version {version:#x} looks big-endian, which is not supported", 4)
    if version not in VERSIONS:
        raise w.fail(f"version {version} is not supported (only 2 and 3)", 4)
    n_tensors = w.u64("the tensor count")
    n_kv = w.u64("the metadata count")
    # Every key/value takes at least 8 (key length) + 1 (key) + 4 (type) + 1 bytes, and every
    # tensor info 8 + 1 + 4 + 8 + 4 + 8: a count the file cannot hold is refused before looping.
    for count, limit, least, what, at in (
        (n_tensors, MAX_TENSORS, 33, "tensor count", 8),
        (n_kv, MAX_KV, 14, "metadata count", 16),
    ):
        if count > limit:
            raise w.fail(f"the {what} is {count:,}, over the limit of {limit:,}", at)
        if count * least > w.size - w.pos:
            raise w.fail(f"the {what} is {count:,}, more than the file can hold", at)

    keys: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        start = w.pos
        key = w.text(f"the key of metadata entry {i}", limit=1 << 16)
        if not key:
            raise w.fail(f"metadata entry {i} has an empty key", start)
        if key in keys:
            raise w.fail(f"metadata key {key!r} appears twice", start)
        keys.add(key)
        kind_at = w.pos
        kind = w.value_type(f"metadata {key!r}")
        value = w.skip_value(kind, f"metadata {key!r}")
        if key == "general.alignment":
            if kind != UINT32:
                name = VALUE_TYPES[kind][0]
                raise w.fail(f"general.alignment is {name}; it must be UINT32", kind_at)
            assert value is not None
            if value == 0 or value & (value - 1):
                raise w.fail(f"general.alignment is {value}; it must be a power of two", kind_at)
            alignment = value

    known = {int(t): v for t, v in gguf.GGML_QUANT_SIZES.items()}  # type -> (block, bytes)
    names: set[str] = set()
    tensors: list[tuple[str, int, int, int]] = []  # name, offset, bytes, where its info is
    for i in range(n_tensors):
        start = w.pos
        name = w.text(f"the name of tensor {i}", limit=1 << 16)
        what = f"tensor {name!r}"
        if not name or len(name.encode()) > MAX_NAME_BYTES:
            raise w.fail(f"tensor {i}'s name is empty or over {MAX_NAME_BYTES} bytes", start)
        if name in names:
            raise w.fail(f"{what} appears twice", start)
        names.add(name)
        dims_at = w.pos
        n_dims = w.u32(f"the dimension count of {what}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.fail(f"{what} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}", dims_at)
        shape = [w.u64(f"dimension {d} of {what}") for d in range(n_dims)]
        elements = 1
        for d in shape:
            if d > _INT63:
                raise w.fail(f"{what} has a dimension of {d:,}, over 2^63 - 1", dims_at)
            elements *= d  # Python ints do not wrap; compare once per factor
            if elements > _INT63:
                raise w.fail(f"{what}'s shape {shape} has over 2^63 elements", dims_at)
        type_at = w.pos
        ggml_type = w.u32(f"the type of {what}")
        if ggml_type not in known:
            raise w.fail(f"{what} has unknown ggml type {ggml_type}", type_at)
        block, type_bytes = known[ggml_type]
        if shape[0] % block:
            raise w.fail(
                f"{what}'s first dimension {shape[0]} is not a multiple of its type's block "
                f"size {block}",
                dims_at,
            )
        nbytes = elements // block * type_bytes
        offset_at = w.pos
        offset = w.u64(f"the data offset of {what}")
        if offset % alignment:
            raise w.fail(
                f"{what}'s data offset {offset:,} is not a multiple of {alignment}", offset_at
            )
        tensors.append((name, offset, nbytes, offset_at))

    data_start = -(-w.pos // alignment) * alignment
    if data_start > w.size:
        raise w.fail("the file ends before its tensor data starts", w.size)
    end = 0  # tensors must come in order, each after the previous one's data
    for name, offset, nbytes, at in tensors:
        if offset < end:
            raise w.fail(
                f"tensor {name!r}'s data at offset {offset:,} overlaps the previous tensor's "
                f"(which ends at {end:,}) or is out of order",
                at,
            )
        end = offset + nbytes
        if data_start + end > w.size:
            raise w.fail(
                f"tensor {name!r}'s data ends at byte {data_start + end:,}, past the end of the "
                "file",
                at,
            )
    return GGUFLayout(version, n_kv, n_tensors, alignment, data_start, data_start + end)
