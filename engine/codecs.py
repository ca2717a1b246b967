"""Tensor codecs over safetensors (docs/protocol.md "Tensors"): fp32, fp16, blockwise int8 and int4, and
sparse top-k (engine/lowbit.py).

Decoding only ever parses safetensors (a JSON header plus raw little-endian arrays), so bytes from
volunteers can never execute code; everything is validated and garbage raises CodecError. The arrays are
read in place (torch.frombuffer): parse() checks a blob and gives a Packed, whose int8 tensors are
dequantized only where they are used, a cache-sized chunk at a time, so that an update can be checked and
folded into a round's sum without ever holding a float copy of it (engine/aggregate.py, projects/).
"""

from __future__ import annotations

import json
import math
import struct
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engine import lowbit

CODECS = ("fp32", "fp16", "int8", "int4", "topk")
LOWBIT = ("int4", "topk")
FEEDBACK = ("int8", "int4", "topk")  # lossy enough that volunteers carry what they drop (ErrorFeedback)
SCALE_SUFFIX = ":scale"
INDEX_SUFFIX = ":index"
SHAPE_PREFIX = "shape:"  # metadata: the dense shape of an int4 or topk tensor, as "d0,d1,..."
# What an int4 or topk blob may declare in all (its dense tensors are allocated when decoded): the graph
# format's own limit on a model's parameters (engine/spec.json), so that a small blob cannot claim more.
MAX_ELEMENTS = 200_000_000
DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 256, "topk": 4096}
TOPK_DENSITY = 64  # topk's default keep: one value in this many (block_size // TOPK_DENSITY a block)
MAX_BLOCK_SIZE = 1 << 20
# Bounds on hostile headers (the safetensors library itself allows a 100 MB header, which takes seconds
# and gigabytes to parse): real headers hold one short entry per tensor, a few KB.
MAX_HEADER = 16 * 2**20
MAX_JSON_DEPTH = 32
MAX_TENSORS = 10_000
MAX_DIMS = 16
MAX_SIZE = 2**62  # any dimension or offset beyond this cannot describe bytes we hold
# Bytes per element of the safetensors dtypes decode accepts (int8 only as a quantised tensor).
ITEMSIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
METADATA = "__metadata__"
# Elements per step of the int8 loops (a 2 MB float32 copy): big enough that the few torch calls per step
# cost little, small enough to stay in the cache.
CHUNK = 1 << 19
# int8 tensors up to this size (biases, norms: most of a model's tensors, few of its values) are dequantized
# together by gathering rather than one loop each, whose fixed cost would outweigh theirs.
SMALL = 1 << 14
# Headers up to this size are parsed and checked once per process (updates of one model share theirs).
CACHED_HEADER = 1 << 20
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class CodecError(ValueError):
    """Bytes that are not a valid encoding (garbage, unknown codec, missing/bad scales)."""


def _as_tensor(value: Tensor | np.ndarray) -> Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, Tensor):
        return value.detach().cpu()
    raise CodecError(f"expected a tensor or numpy array, got {type(value).__name__}")


def quantize_int8(x: Tensor, block_size: int, level: int = 127) -> tuple[Tensor, Tensor]:
    """(int8 values with x's shape, one float32 absmax/level scale per block of the flat tensor): per block,
    round(x / scale) (x / 1 for an all-zero block, whose scale stays 0), a cache-sized chunk at a time.
    int4 is the same with level 7."""
    flat = x.detach().float().reshape(-1)
    q, scale = torch.empty(flat.shape, dtype=torch.int8), torch.empty(math.ceil(flat.numel() / block_size))
    (x_full, x_rest), (q_full, q_rest) = _rows(flat, block_size), _rows(q, block_size)
    full, rows = x_full.shape[0], max(1, CHUNK // block_size)
    scratch, s_full = _scratch(min(full, rows) * block_size).view(-1, block_size), scale[:full]
    for first in range(0, full, rows):
        values = scratch if first + rows <= full else scratch[: full - first]
        rows_at = slice(first, first + rows)
        _quantize_rows(x_full[rows_at], values, q_full[rows_at], s_full[rows_at], level)
    if x_rest.numel():
        _quantize_rows(x_rest, torch.empty(x_rest.shape), q_rest, scale[full:], level)
    return q.reshape(x.shape), scale


def _quantize_rows(x: Tensor, work: Tensor, q: Tensor, scale: Tensor, level: int) -> None:
    torch.abs(x, out=work)
    torch.amax(work, dim=1, out=scale)
    scale.div_(float(level))
    torch.div(x, torch.where(scale > 0, scale, 1.0)[:, None], out=work)
    q.copy_(work.round_().clamp_(-level, level))


def dequantize_int8(q: Tensor, scale: Tensor, block_size: int) -> Tensor:
    """value = int8 * the scale of its block of the flattened tensor, as float32."""
    out = torch.empty(q.shape)
    for values, scales, target in _int8_steps(q, scale, block_size, out):
        torch.mul(values, scales, out=target)
    return out


def _rows(t: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """A contiguous tensor's elements as rows of whole blocks, and the partial last block as one row."""
    flat = t.reshape(-1)
    full = flat.numel() // block_size
    return flat[: full * block_size].view(full, block_size), flat[full * block_size :].view(1, -1)


def _int8_steps(
    q: Tensor, scale: Tensor, block_size: int, out: Tensor | None = None
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(float32 copy of some rows of blocks of `q`, their scales as a column, the same rows of `out`) for
    CHUNK elements at a time, then the partial last block. The loops over them (dequantising, folding into a
    sum, norms) fill one cache-sized copy at a time rather than a float copy of the whole tensor: allocating
    and filling that cost more than their arithmetic. One loop at a time per thread (the copy is reused)."""
    q_full, q_rest = _rows(q, block_size)
    o_full, o_rest = _rows(out, block_size) if out is not None else (q_full, q_rest)
    full, rows = q_full.shape[0], max(1, CHUNK // block_size)
    s_full, s_rest = scale[:full, None], scale[full:, None]
    scratch = _scratch(min(full, rows) * block_size).view(-1, block_size)
    for first in range(0, full, rows):
        values = scratch if first + rows <= full else scratch[: full - first]
        values.copy_(q_full[first : first + rows])
        yield values, s_full[first : first + rows], o_full[first : first + rows]
    if q_rest.numel():
        yield q_rest.float(), s_rest, o_rest


def _int4_steps(
    packed: Tensor, scale: Tensor, block_size: int, shape: tuple[int, ...], out: Tensor | None = None
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """_int8_steps for int4: each chunk's nibbles unpacked into the cache-sized float32 copy."""
    elements, half = math.prod(shape), block_size // 2
    full = elements // block_size
    p_full = packed[: full * half].view(full, half)
    o_full, o_rest = _rows(out, block_size) if out is not None else (p_full, p_full[:0])
    rows = max(1, CHUNK // block_size)
    s_full, s_rest = scale[:full, None], scale[full:, None]
    scratch = _scratch(min(full, rows) * block_size).view(-1, block_size)
    for first in range(0, full, rows):
        chunk = p_full[first : first + rows]
        values = lowbit.unpack_nibbles_into(chunk, scratch[: chunk.shape[0]])
        yield values, s_full[first : first + rows], o_full[first : first + rows]
    rest = elements - full * block_size
    if rest:
        tail = packed[full * half :]
        yield (
            lowbit.unpack_nibbles_into(tail, torch.empty(2 * tail.numel()))[:rest].view(1, -1),
            s_rest,
            o_rest,
        )


_local = threading.local()


def _scratch(size: int) -> Tensor:
    buffer: Tensor | None = getattr(_local, "scratch", None)
    if buffer is None or buffer.numel() < size:
        buffer = _local.scratch = torch.empty(max(size, CHUNK))
    return buffer[:size]


def _memory(t: Tensor) -> memoryview:
    """The tensor's bytes without a copy (it is contiguous)."""
    # Through numpy's own buffer: a third of the cost of reshape + view + numpy (0.1 ms against 0.3 for a
    # ResNet-18's 102 tensors, on a publish's critical path). Never bfloat16, which numpy lacks: encoding
    # converts floats to the codec's dtype first. An empty one has no bytes (and a shape cast refuses).
    return t.numpy().data.cast("B") if t.numel() else memoryview(b"")


def _encode_one(name: str, t: Tensor, codec: str, block_size: int, keep: int) -> dict[str, Tensor]:
    if t.dtype not in SAFETENSORS_DTYPES:
        raise CodecError(f"tensor '{name[:100]}': cannot encode {t.dtype}")
    if not t.is_floating_point():
        return {name: t.contiguous()}  # labels/token ids travel unchanged
    if codec in ("fp32", "fp16"):
        return {name: (t.float() if codec == "fp32" else t.half()).contiguous()}
    if codec == "int8":
        q, scale = quantize_int8(t, block_size)
        return {name: q, name + SCALE_SUFFIX: scale}
    if codec == "int4":
        q, scale = quantize_int8(t, block_size, lowbit.INT4_LEVEL)
        return {name: lowbit.pack_nibbles(q), name + SCALE_SUFFIX: scale}
    offsets, values = lowbit.topk_select(t, block_size, keep)
    q, scale = quantize_int8(values, keep)
    return {name: q, name + INDEX_SUFFIX: offsets, name + SCALE_SUFFIX: scale}


def default_block_size(codec: str) -> int:
    """The block size volunteers and the server use for `codec` (256 for those without blocks)."""
    return DEFAULT_BLOCK_SIZES.get(codec, 256)


def default_keep(block_size: int) -> int:
    """topk's values per block unless told: one in TOPK_DENSITY."""
    return max(1, block_size // TOPK_DENSITY)


def _check_options(codec: str, block_size: int, keep: int) -> None:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r} (expected one of {list(CODECS)})")
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"block_size must be in 1..{MAX_BLOCK_SIZE}")
    if codec == "int4" and block_size % 2:
        raise CodecError("int4 needs an even block_size (two values a byte)")
    if codec == "topk" and not (block_size <= lowbit.MAX_TOPK_BLOCK and 0 < keep <= block_size):
        raise CodecError(f"topk needs block_size <= {lowbit.MAX_TOPK_BLOCK} and keep in 1..block_size")


def encode(
    tensors: Mapping[str, Tensor | np.ndarray],
    codec: str = "fp32",
    block_size: int = 256,
    metadata: Mapping[str, str] | None = None,
    *,
    keep: int | None = None,
) -> bytes:
    """safetensors bytes: the tensors (floats under `codec`) and metadata with the codec and block size
    (and for topk the values kept per block, `keep`: default_keep(block_size) unless given)."""
    return b"".join(encode_parts(tensors, codec, block_size, metadata, keep=keep))


def encode_parts(
    tensors: Mapping[str, Tensor | np.ndarray],
    codec: str = "fp32",
    block_size: int = 256,
    metadata: Mapping[str, str] | None = None,
    *,
    keep: int | None = None,
) -> list[memoryview]:
    """encode's bytes in pieces, to hash and write one after the other instead of joining them: the header,
    then each tensor's own memory where it can be (float32 tensors under fp32 are not copied). The pieces
    share memory with `tensors`, so use them before changing those."""
    keep = default_keep(block_size) if keep is None else keep
    _check_options(codec, block_size, keep)
    out: dict[str, Tensor] = {}
    meta = {**(metadata or {}), "codec": codec, "block_size": str(block_size)}
    if codec == "topk":
        meta["keep"] = str(keep)
    for name, value in tensors.items():
        t = _as_tensor(value)
        entries = _encode_one(name, t, codec, block_size, keep)
        if any(key in out or key == METADATA for key in entries):
            raise CodecError(f"tensor '{name}' collides with a scale or index entry or the metadata")
        if codec in LOWBIT and t.is_floating_point():
            meta[SHAPE_PREFIX + name] = ",".join(str(d) for d in t.shape)
        out.update(entries)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CodecError("metadata keys and values must be strings")
    header, named = _serialized(out, meta)
    return [header, *(piece for _, piece in named)]


def encode_fp32_named(tensors: Mapping[str, Tensor]) -> tuple[memoryview, list[tuple[str, memoryview]]]:
    """encode_parts(tensors) (fp32) as the header and then (name, the tensor's own memory) in the order of
    the bytes, for tensors that need no conversion: a caller changing them one by one may hash each piece
    once it is final."""
    for name, t in tensors.items():
        if (t.is_floating_point() and t.dtype != torch.float32) or not t.is_contiguous():
            raise CodecError(f"tensor '{name[:100]}': not contiguous float32 (or integer)")
        if t.dtype not in SAFETENSORS_DTYPES:
            raise CodecError(f"tensor '{name[:100]}': cannot encode {t.dtype}")
    return _serialized(dict(tensors), {"codec": "fp32", "block_size": "256"})


def _serialized(
    tensors: Mapping[str, Tensor], meta: Mapping[str, str]
) -> tuple[memoryview, list[tuple[str, memoryview]]]:
    specs = tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
    header, order = _header_of(specs, tuple(sorted(meta.items())))
    return header, [(name, _memory(tensors[name])) for name in order]


Specs = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


@lru_cache(maxsize=32)
def _header_of(specs: Specs, meta: tuple[tuple[str, str], ...]) -> tuple[memoryview, tuple[str, ...]]:
    """The header of tensors named, typed and shaped as `specs` (with `meta`, sorted), and their order in
    the bytes. A model's are the same at every version, so a publish builds them once (a ResNet-18's 102
    tensors took 0.3 ms, before its step could start)."""
    # The safetensors layout: tensors with the widest elements first, so every one is aligned in the file
    # (the header is padded to 8 bytes); sorted metadata, so the same tensors always give the same bytes.
    ordered = sorted(specs, key=lambda spec: (-spec[1].itemsize, spec[0]))
    header: dict[str, Any] = {METADATA: dict(meta)}
    offset = 0
    for name, dtype, shape in ordered:
        size = math.prod(shape) * dtype.itemsize
        entry = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        header[name], offset = entry, offset + size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return memoryview(struct.pack("<Q", len(raw)) + raw), tuple(name for name, _, _ in ordered)


# --- hostile JSON and safetensors headers -----------------------------------------------------------

# Every byte but the five that decide JSON nesting; deleting them leaves a short string to scan.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = np.zeros(256, np.int32)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_QUOTE = ord('"')


def json_depth(data: bytes | str, chunk: int = 1 << 20) -> int:
    """Deepest nesting of [ and { outside strings, found without parsing, in bounded memory.

    Escaped backslashes and quotes go first (left to right, as JSON reads them), so every quote left
    opens or closes a string. Invalid JSON may be misjudged, but then json.loads refuses it anyway.
    """
    raw = data.encode("utf-8", "replace") if isinstance(data, str) else bytes(data)
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    codes = np.frombuffer(text, np.uint8)
    deepest = depth = quotes = 0
    for start in range(0, len(codes), chunk):
        part = codes[start : start + chunk]
        quote_counts = np.cumsum(part == _QUOTE, dtype=np.int64) + quotes
        levels = depth + np.cumsum(np.where(quote_counts & 1, 0, _STEP[part]), dtype=np.int64)
        deepest = max(deepest, int(levels.max()))
        depth, quotes = int(levels[-1]), int(quote_counts[-1])
    return deepest


def json_loads_bounded(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for hostile input: nesting is bounded before parsing, and every failure (including
    the interpreter's own recursion limit) is a ValueError."""
    depth = json_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth:,} levels deep (at most {max_depth})")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested too deeply (at most {max_depth} levels)") from None


def check_header_length(prefix: bytes | memoryview, max_header: int = MAX_HEADER) -> int:
    """The header length declared by a safetensors file's first 8 bytes, if at most ``max_header``:
    callers holding a file can refuse a huge header before reading the rest."""
    if len(prefix) < 8:
        raise CodecError("not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", prefix[:8])
    if size > max_header:
        raise CodecError(f"safetensors header of {size:,} bytes (at most {max_header:,})")
    return int(size)


def _read_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json_loads_bounded(raw)
    except ValueError as exc:  # includes UnicodeDecodeError
        raise CodecError(f"not a safetensors file (bad header: {str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise CodecError("not a safetensors file (the header is not an object)")
    return header


def _read_metadata(header: Mapping[str, Any]) -> dict[str, str]:
    meta = header.get(METADATA, {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CodecError("bad safetensors metadata")
    return meta


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SIZE


def _check_entry(name: str, info: Any, buffer: int) -> None:
    """One tensor's header entry, checked before the library allocates anything for it."""
    where = f"tensor {name[:100]!r}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CodecError(f"{where}: a header entry needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZES:
        raise CodecError(f"{where}: unsupported dtype {str(dtype)[:20]!r} (one of {list(ITEMSIZES)})")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_size(d) for d in shape):
        raise CodecError(f"{where}: shape must be at most {MAX_DIMS} non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)):
        raise CodecError(f"{where}: data_offsets must be two non-negative ints")
    begin, end = offsets
    if not begin <= end <= buffer or end - begin != math.prod(shape) * ITEMSIZES[dtype]:
        raise CodecError(
            f"{where}: shape {shape[:8]} of {dtype} does not fit data_offsets {offsets} "
            f"in a buffer of {buffer:,} bytes"
        )


def _check_entries(header: Mapping[str, Any], buffer: int) -> None:
    names = [name for name in header if name != METADATA]
    if len(names) > MAX_TENSORS:
        raise CodecError(f"{len(names):,} tensors (at most {MAX_TENSORS:,})")
    for name in names:
        _check_entry(name, header[name], buffer)


def _parse_block_size(meta: Mapping[str, str]) -> int:
    raw = meta.get("block_size", "256")
    # isdigit() alone accepts '²' and other digits int() refuses; the length bound keeps int() cheap.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 0 < int(raw) <= MAX_BLOCK_SIZE:
        raise CodecError(f"bad block_size {raw[:20]!r}")
    return int(raw)


def _check_layout(header: Mapping[str, Any], buffer: int) -> None:
    """The tensors' bytes tile the buffer, as safetensors requires: no overlap, no gap, nothing after."""
    end = 0
    for begin, stop in sorted(
        tuple(info["data_offsets"]) for name, info in header.items() if name != METADATA
    ):
        if begin != end:
            raise CodecError(f"tensor data at bytes {begin:,}-{stop:,} overlaps or leaves a gap before it")
        end = stop
    if end != buffer:
        raise CodecError(f"the tensors' data ends at byte {end:,} of a buffer of {buffer:,}")


@dataclass(frozen=True)
class _Gather:
    """Small int8 tensors dequantized in one go: for each of their elements, its byte in the data and the
    float32 index there of its block's scale."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    values: Tensor
    scales: Tensor


@dataclass(frozen=True)
class _Lowbit:
    """Where an int4 or topk tensor's parts are (byte offsets into the data after the header)."""

    values: int  # int4: the packed bytes; topk: the int8 values
    scales: int
    count: int  # int4: packed bytes; topk: values kept
    offsets: int = -1  # topk: the int16 offsets within blocks


@dataclass(frozen=True)
class _Layout:
    """A checked header: what a blob holds and where (byte offsets into the data after the header)."""

    codec: str
    block_size: int
    meta: dict[str, str]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]]  # dtype, shape, offset (scales excluded)
    scales: dict[str, int]  # an int8 tensor's name: the offset of its float32 block scales
    scale_spans: tuple[tuple[int, int], ...]  # the bytes holding every scale, adjacent ranges merged
    gathers: dict[tuple[str, ...], _Gather | None] = field(default_factory=dict)
    lowbit: dict[str, _Lowbit] = field(default_factory=dict)  # int4 and topk tensors
    keep: int = 0  # topk: values per block

    def scale_arrays(self) -> list[tuple[str, int, int]]:
        """(tensor, offset, how many) of every float32 scale array."""
        blocks = {
            name: math.ceil(math.prod(self.tensors[name][1]) / self.block_size) for name in self.tensors
        }
        arrays = [(name, offset, blocks[name]) for name, offset in self.scales.items()]
        return arrays + [(name, low.scales, blocks[name]) for name, low in self.lowbit.items()]

    def gather(self, names: tuple[str, ...]) -> _Gather | None:
        """The gather of the small int8 tensors among `names`, if any (and their scales are aligned)."""
        if names not in self.gathers:
            if len(self.gathers) > 16:
                self.gathers.clear()  # names come from the server's graphs: a few sets per model
            self.gathers[names] = self._gather(names)
        return self.gathers[names]

    def _gather(self, names: tuple[str, ...]) -> _Gather | None:
        small = [n for n in names if n in self.scales and math.prod(self.tensors[n][1]) <= SMALL]
        if not small or any(self.scales[n] % 4 for n in small):
            return None
        sizes = tuple(math.prod(self.tensors[n][1]) for n in small)
        offsets = [(self.tensors[n][2], self.scales[n] // 4) for n in small]
        values = torch.cat(
            [torch.arange(at, at + size) for (at, _), size in zip(offsets, sizes, strict=True)]
        )
        scales = torch.cat(
            [
                scale + torch.arange(size) // self.block_size
                for (_, scale), size in zip(offsets, sizes, strict=True)
            ]
        )
        return _Gather(tuple(small), sizes, values, scales)


def _layout(raw: bytes, buffer: int) -> _Layout:
    """The checked layout of a header (`raw`, its JSON) before `buffer` bytes of tensor data."""
    return _cached_layout(raw, buffer) if len(raw) <= CACHED_HEADER else _new_layout(raw, buffer)


@lru_cache(maxsize=32)
def _cached_layout(raw: bytes, buffer: int) -> _Layout:
    # Only what the header says is cached, never the data: a header is checked once, not once per update.
    return _new_layout(raw, buffer)


def _new_layout(raw: bytes, buffer: int) -> _Layout:
    header = _read_header(raw)
    meta = _read_metadata(header)
    codec = meta.get("codec", "fp32")
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec[:20]!r}")
    block_size = _parse_block_size(meta)
    _check_entries(header, buffer)
    _check_layout(header, buffer)
    entries = {
        name: (TORCH_DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"][0])
        for name, info in header.items()
        if name != METADATA
    }
    if codec in LOWBIT:
        return _lowbit_layout(entries, codec, block_size, meta)
    if codec != "int8":
        if any(dtype == torch.int8 for dtype, _, _ in entries.values()):
            raise CodecError(f"int8 tensors in a {codec} blob")
        return _Layout(codec, block_size, meta, entries, {}, ())
    return _int8_layout(entries, block_size, meta)


Entries = dict[str, tuple[torch.dtype, tuple[int, ...], int]]


def _lowbit_layout(entries: Entries, codec: str, block_size: int, meta: dict[str, str]) -> _Layout:
    """Each tensor with a dense shape in the metadata paired with its parts (then no tensors of their own);
    the others (labels, ids) are plain."""
    keep = _parse_keep(meta, block_size) if codec == "topk" else 0
    if codec == "int4" and block_size % 2:
        raise CodecError("int4 needs an even block_size")
    shapes = {
        key[len(SHAPE_PREFIX) :]: _parse_shape(key, raw)
        for key, raw in meta.items()
        if key.startswith(SHAPE_PREFIX)
    }
    if sum(math.prod(shape) for shape in shapes.values()) > MAX_ELEMENTS:
        raise CodecError(f"the tensors declare more than {MAX_ELEMENTS:,} elements")
    parts = {
        name: _lowbit_parts(name, shape, entries, codec, block_size, keep) for name, shape in shapes.items()
    }
    taken = {part for found in parts.values() for part in found[1]}
    tensors = {name: entries[name] for name in entries if name not in taken}
    for name, shape in shapes.items():
        tensors[name] = (entries[name][0], shape, entries[name][2])
    lows = {name: found[0] for name, found in parts.items()}
    spans = _spans(
        [(low.scales, 4 * math.ceil(math.prod(shapes[n]) / block_size)) for n, low in lows.items()]
    )
    return _Layout(codec, block_size, meta, tensors, {}, spans, lowbit=lows, keep=keep)


def _parse_keep(meta: Mapping[str, str], block_size: int) -> int:
    raw = meta.get("keep", "")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 0 < int(raw) <= block_size:
        raise CodecError(f"bad keep {raw[:20]!r} (1..block_size values per block)")
    if block_size > lowbit.MAX_TOPK_BLOCK:
        raise CodecError(f"topk block_size {block_size} (at most {lowbit.MAX_TOPK_BLOCK})")
    return int(raw)


def _parse_shape(key: str, raw: str) -> tuple[int, ...]:
    dims = raw.split(",") if raw else []
    if len(dims) > MAX_DIMS or not all(d.isascii() and d.isdigit() and len(d) <= 12 for d in dims):
        raise CodecError(f"bad dense shape {raw[:40]!r} for {key[:100]!r}")
    return tuple(int(d) for d in dims)


def _lowbit_parts(
    name: str, shape: tuple[int, ...], entries: Entries, codec: str, block_size: int, keep: int
) -> tuple[_Lowbit, tuple[str, ...]]:
    """An int4 or topk tensor's parts, checked against its dense shape: where they are, and their names."""
    elements = math.prod(shape)
    blocks = math.ceil(elements / block_size)
    if codec == "int4":
        want = {
            name: (torch.uint8, (math.ceil(elements / 2),)),
            name + SCALE_SUFFIX: (torch.float32, (blocks,)),
        }
    else:
        count = (lowbit.topk_count(elements, block_size, keep),)
        want = {
            name: (torch.int8, count),
            name + INDEX_SUFFIX: (torch.int16, count),
            name + SCALE_SUFFIX: (torch.float32, (blocks,)),
        }
    for part, expected in want.items():
        if part not in entries or entries[part][:2] != expected:
            raise CodecError(
                f"tensor '{name[:100]}': missing or malformed '{part[:120]}' for shape {shape[:8]}"
            )
    offsets = entries[name + INDEX_SUFFIX][2] if codec == "topk" else -1
    found = _Lowbit(entries[name][2], entries[name + SCALE_SUFFIX][2], want[name][1][0], offsets)
    return found, tuple(want)


def _spans(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(offset, size) byte ranges as sorted (begin, end) spans, adjacent ones merged."""
    spans: list[tuple[int, int]] = []
    for offset, size in sorted(ranges):
        if spans and spans[-1][1] == offset:
            spans[-1] = (spans[-1][0], offset + size)
        else:
            spans.append((offset, offset + size))
    return tuple(spans)


def _int8_layout(
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]], block_size: int, meta: dict[str, str]
) -> _Layout:
    """Each int8 tensor paired with its scales (which are then no tensors of their own)."""
    tensors, scales = {}, {}
    for name, (dtype, shape, offset) in entries.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in entries:
            continue
        tensors[name] = (dtype, shape, offset)
        if dtype != torch.int8:
            continue
        scale = entries.get(name + SCALE_SUFFIX)
        if scale is None or scale[:2] != (torch.float32, (math.ceil(math.prod(shape) / block_size),)):
            raise CodecError(f"tensor '{name}': missing or malformed '{name}{SCALE_SUFFIX}'")
        scales[name] = scale[2]
    spans: list[tuple[int, int]] = []
    for name, offset in sorted(scales.items(), key=lambda item: item[1]):
        end = offset + 4 * math.ceil(math.prod(tensors[name][1]) / block_size)
        if spans and spans[-1][1] == offset:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((offset, end))
    return _Layout("int8", block_size, meta, tensors, scales, tuple(spans))


class Packed(Mapping[str, Tensor]):
    """A checked blob, not decoded yet: its tensors are views of its bytes, int8 ones with block scales.

    As a mapping it decodes the tensor asked for (floats as float32). Its own methods work on the stored
    values instead, a cache-sized chunk at a time: an update is checked (finite, sq_norm) and folded into a
    round's sum (add_to) without a float copy of it ever being made.
    """

    def __init__(
        self, data: dict[torch.dtype, Tensor], layout: _Layout, names: tuple[str, ...], largest: float
    ):
        # data: the bytes after the header viewed as each dtype that starts aligned (uint8 always).
        self._data, self._layout, self._names, self._largest_scale = data, layout, names, largest
        self.meta, self.block_size = dict(layout.meta), layout.block_size

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._layout.tensors or name not in self._names:
            raise KeyError(name)
        return self._decoded(name, copy=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self._layout.tensors[name][1]

    def dtype(self, name: str) -> torch.dtype:
        """As stored (int8 for a quantised tensor)."""
        return self._layout.tensors[name][0]

    def is_float(self, name: str) -> bool:
        layout = self._layout
        return name in layout.scales or name in layout.lowbit or layout.tensors[name][0].is_floating_point

    def select(self, names: Iterable[str]) -> Packed:
        """The same blob limited to `names` (all of which it has)."""
        chosen = tuple(names)
        if not set(chosen) <= set(self._names):
            raise KeyError(sorted(set(chosen) - set(self._names))[:5])
        return Packed(self._data, self._layout, chosen, self._largest_scale)

    def decode(self, *, copy: bool = True) -> dict[str, Tensor]:
        """Every tensor decoded (floats as float32). copy=False lets float32 and integer tensors stay views
        of the bytes parsed, so changing them changes those (they are writable if the bytes were)."""
        return {name: self._decoded(name, copy=copy) for name in self._names}

    def finite(self, name: str) -> bool:
        """Whether every value of `name` (a float tensor) is finite once decoded."""
        if name in self._layout.lowbit:
            overflows = self._largest_scale * 128 > FLOAT32_MAX
            return not overflows or bool(torch.isfinite(self._decoded(name, copy=False)).all())
        if name not in self._layout.scales:
            return bool(torch.isfinite(self._stored(name)).all())
        # Scales are finite (parse checked): only a product with one near float32's maximum can overflow,
        # which no honest encoder makes, so only then are the values looked at.
        if self._largest_scale * 128 <= FLOAT32_MAX:
            return True
        steps = _int8_steps(self._stored(name), self._scale(name), self.block_size)
        return all(bool(torch.isfinite(values.mul_(scales)).all()) for values, scales, _ in steps)

    def sq_norm(self) -> float:
        """The squared L2 norm of all its tensors (floats: see finite), summed in float64."""
        gather = self._gather()
        alone = [name for name in self._names if gather is None or name not in gather.names]
        total = sum(self._sq_norm(name) for name in alone)
        if gather is not None:
            total += float(self._gathered(gather).double().square().sum())
        return total

    def add_to(self, sums: Mapping[str, Tensor], weight: float) -> None:
        """sums[name] += weight * each decoded tensor; int8 values are dequantized straight into the sums."""
        for name in self._names:
            if tuple(sums[name].shape) != self.shape(name):
                raise ValueError(f"'{name}' has shape {self.shape(name)}, its sum {tuple(sums[name].shape)}")
        gather = self._gather()
        for name in self._names:
            if gather is None or name not in gather.names:
                self._add(name, sums[name], weight)
        if gather is not None:
            pieces = torch.split(self._gathered(gather).mul_(weight), list(gather.sizes))
            for name, piece in zip(gather.names, pieces, strict=True):
                sums[name].view(-1).add_(piece)

    def _add(self, name: str, out: Tensor, weight: float) -> None:
        if name in self._layout.lowbit:
            self._add_lowbit(name, out, weight)
            return
        if name not in self._layout.scales:
            out.add_(self._stored(name), alpha=weight)
            return
        for values, scales, target in _int8_steps(
            self._stored(name), self._scale(name) * weight, self.block_size, out
        ):
            target.addcmul_(values, scales)

    def _sq_norm(self, name: str) -> float:
        if name not in self._layout.scales and name not in self._layout.lowbit:
            return float(torch.linalg.vector_norm(self._stored(name), dtype=torch.float64)) ** 2
        total = 0.0
        # Per block: the norm of its int8 values (exact in float32 up to 2^20 of them) times its scale.
        for values, scales, _ in self._steps(name):
            rows = torch.linalg.vector_norm(values, dim=1).double() * scales[:, 0].double()
            total += float(rows.dot(rows))
        return total

    def _steps(self, name: str) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """The quantised values of `name` a chunk at a time (topk: its kept values, `keep` a block)."""
        low = self._layout.lowbit.get(name)
        if low is None:
            return _int8_steps(self._stored(name), self._scale(name), self.block_size)
        if low.offsets < 0:
            return _int4_steps(self._packed(low), self._scale(name), self.block_size, self.shape(name))
        return _int8_steps(self._kept(low), self._scale(name), self._layout.keep)

    def _add_lowbit(self, name: str, out: Tensor, weight: float) -> None:
        low = self._layout.lowbit[name]
        scales = self._scale(name) * weight
        if low.offsets < 0:
            for values, block_scales, target in _int4_steps(
                self._packed(low), scales, self.block_size, self.shape(name), out
            ):
                target.addcmul_(values, block_scales)
            return
        # Sparse: only the kept values are touched, at their positions (distinct: parse checked).
        values = dequantize_int8(self._kept(low), scales, self._layout.keep)
        out.view(-1).index_add_(0, self._positions(low), values)

    def _decoded_lowbit(self, name: str) -> Tensor:
        low, shape = self._layout.lowbit[name], self.shape(name)
        if low.offsets >= 0:
            out = torch.zeros(math.prod(shape))
            out[self._positions(low)] = dequantize_int8(self._kept(low), self._scale(name), self._layout.keep)
            return out.view(shape)
        out = torch.empty(shape)
        for values, scales, target in _int4_steps(
            self._packed(low), self._scale(name), self.block_size, shape, out
        ):
            torch.mul(values, scales, out=target)
        return out

    def _packed(self, low: _Lowbit) -> Tensor:
        return self._slice(torch.uint8, low.values, (low.count,))

    def _kept(self, low: _Lowbit) -> Tensor:
        return self._slice(torch.int8, low.values, (low.count,))

    def _positions(self, low: _Lowbit) -> Tensor:
        offsets = self._slice(torch.int16, low.offsets, (low.count,))
        return lowbit.topk_positions(offsets, self.block_size, self._layout.keep)

    def _decoded(self, name: str, *, copy: bool) -> Tensor:
        if name in self._layout.lowbit:
            return self._decoded_lowbit(name)
        t = self._stored(name)
        if name in self._layout.scales:
            return dequantize_int8(t, self._scale(name), self.block_size)
        if t.is_floating_point() and t.dtype != torch.float32:
            return t.float()
        return t.clone() if copy else t

    def _stored(self, name: str) -> Tensor:
        dtype, shape, offset = self._layout.tensors[name]
        return self._slice(dtype, offset, shape)

    def _scale(self, name: str) -> Tensor:
        blocks = math.ceil(math.prod(self.shape(name)) / self.block_size)
        low = self._layout.lowbit.get(name)
        offset = low.scales if low is not None else self._layout.scales[name]
        return self._slice(torch.float32, offset, (blocks,))

    def _slice(self, dtype: torch.dtype, offset: int, shape: tuple[int, ...]) -> Tensor:
        return _slice(self._data, dtype, offset, shape)

    def _gather(self) -> _Gather | None:
        aligned = torch.float32 in self._data and torch.int8 in self._data
        return self._layout.gather(self._names) if self._layout.scales and aligned else None

    def _gathered(self, gather: _Gather) -> Tensor:
        return self._data[torch.int8][gather.values].float().mul_(self._data[torch.float32][gather.scales])


def _regions(data: memoryview, start: int, layout: _Layout) -> dict[torch.dtype, Tensor]:
    """The bytes after the header as uint8, and as each dtype of the layout that they start aligned for."""
    size = len(data) - start
    if not size:
        return {torch.uint8: torch.empty(0, dtype=torch.uint8)}
    with warnings.catch_warnings():
        # A view of immutable bytes: torch warns that writing to it would change them. Only decode hands
        # tensors out, and it copies unless told not to (see there).
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=start)
    dtypes = {dtype for dtype, _, _ in layout.tensors.values()} | (
        {torch.float32} if layout.scales or layout.lowbit else set()
    )
    if layout.keep:
        dtypes.add(torch.int16)
    regions = {torch.uint8: raw, torch.int8: raw.view(torch.int8)}
    for dtype in dtypes - set(regions):
        width = ITEMSIZES[SAFETENSORS_DTYPES[dtype]]
        if raw.data_ptr() % width == 0:
            regions[dtype] = raw[: size - size % width].view(dtype)
    return regions


def _slice(
    regions: dict[torch.dtype, Tensor], dtype: torch.dtype, offset: int, shape: tuple[int, ...]
) -> Tensor:
    """The tensor at `offset` of the data, a view where it is aligned (every encoder of ours aligns it)."""
    size, count = ITEMSIZES[SAFETENSORS_DTYPES[dtype]], math.prod(shape)
    region = regions.get(dtype)
    if region is not None and offset % size == 0:
        return region[offset // size : offset // size + count].view(shape)
    return regions[torch.uint8][offset : offset + count * size].clone().view(dtype).view(shape)


def _largest_scale(regions: dict[torch.dtype, Tensor], layout: _Layout) -> float:
    """The largest |scale| of an int8 blob, once every scale is known to be finite."""
    spans = [
        _slice(regions, torch.float32, begin, ((end - begin) // 4,)) for begin, end in layout.scale_spans
    ]
    largest = [float(scales.abs().max()) for scales in spans if scales.numel()]
    if all(math.isfinite(value) for value in largest):
        return max(largest, default=0.0)
    for name, offset, blocks in layout.scale_arrays():
        if not bool(torch.isfinite(_slice(regions, torch.float32, offset, (blocks,))).all()):
            raise CodecError(f"tensor '{name}': non-finite scales")
    raise AssertionError("a span of scales held a non-finite one that no tensor's scales hold")


Buffer = bytes | bytearray | memoryview
_WRAPPED = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    RuntimeError,
    RecursionError,
    MemoryError,
)


def parse(data: Buffer, max_header: int = MAX_HEADER) -> Packed:
    """The blob checked and its tensors mapped in place, nothing decoded yet (see Packed).

    Hostile bytes only ever raise CodecError: the header's size, nesting and every entry's dtype, shape
    and offsets are checked before anything is allocated, and whatever else goes wrong is wrapped.
    The Packed keeps `data` alive and reads it: do not change it meanwhile.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("expected bytes")
    try:
        return _parse(memoryview(data).cast("B"), max_header)
    except CodecError:
        raise
    except _WRAPPED as exc:
        raise CodecError(f"invalid safetensors data ({type(exc).__name__}: {str(exc)[:200]})") from None


def decode(
    data: Buffer, max_header: int = MAX_HEADER, *, copy: bool = True
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors (floats as float32, integers unchanged) and the metadata of an encoded blob, checked as
    parse() does. copy=False: float32 and integer tensors may be views of `data` (see Packed.decode)."""
    packed = parse(data, max_header)
    return packed.decode(copy=copy), packed.meta


def _parse(data: memoryview, max_header: int) -> Packed:
    size = check_header_length(data, max_header)  # before anything is read: a huge header costs nothing
    if size > len(data) - 8:
        raise CodecError("not a safetensors file (bad header length)")
    layout = _layout(bytes(data[8 : 8 + size]), len(data) - 8 - size)
    regions = _regions(data, 8 + size, layout)
    if layout.keep:
        _check_offsets(regions, layout)
    return Packed(regions, layout, tuple(layout.tensors), _largest_scale(regions, layout))


def _check_offsets(regions: dict[torch.dtype, Tensor], layout: _Layout) -> None:
    """topk's offsets (data, not header: checked for every blob) within their blocks, none twice."""
    for name, low in layout.lowbit.items():
        offsets = _slice(regions, torch.int16, low.offsets, (low.count,))
        elements = math.prod(layout.tensors[name][1])
        if not lowbit.topk_offsets_valid(offsets, elements, layout.block_size, layout.keep):
            raise CodecError(f"tensor '{name[:100]}': top-k offsets outside their blocks or not increasing")


class ErrorFeedback:
    """Error-feedback compression: what quantisation (or topk's sparsification) drops from one update is
    added to the next, so over many rounds nothing is lost (the residual stays bounded instead of biasing
    training).
    """

    def __init__(self, codec: str = "int8", block_size: int | None = None, keep: int | None = None) -> None:
        self.codec, self.block_size = codec, block_size or default_block_size(codec)
        self.keep = keep
        self.residual: dict[str, Tensor] = {}

    def compress(self, update: Mapping[str, Tensor]) -> bytes:
        corrected = {name: t.detach().float() + self.residual.get(name, 0.0) for name, t in update.items()}
        data = encode(corrected, self.codec, self.block_size, keep=self.keep)
        sent, _ = decode(data)
        self.residual = {name: corrected[name] - sent[name] for name in corrected}
        return data


def weights_delta(
    held: Mapping[str, Tensor],
    weights: Mapping[str, Tensor],
    codec: str,
    block_size: int | None = None,
    keep: int | None = None,
) -> tuple[bytes, dict[str, Tensor]]:
    """The blob taking `held` (what volunteers hold) towards `weights`, compressed with `codec`, and what
    they hold once they apply it (apply_delta): the server keeps that, so what one delta drops is in the
    next (error feedback on the way down)."""
    block = block_size or default_block_size(codec)
    data = encode({name: weights[name] - held[name] for name in held}, codec, block, keep=keep)
    return data, apply_delta(held, data)


def apply_delta(held: Mapping[str, Tensor], data: Buffer) -> dict[str, Tensor]:
    """held + decode(delta), tensor by tensor in its own dtype (float32: what codecs.js applyDelta does)."""
    delta, _ = decode(data)
    if set(delta) != set(held):
        raise CodecError(f"the delta's tensors are not the weights': {sorted(set(delta) ^ set(held))[:5]}")
    return {name: held[name] + delta[name].to(held[name].dtype) for name in held}


class WeightsDeltas:
    """Weights sent down as deltas: the first download whole (in `first_codec`), then each new version as
    its difference to the weights volunteers already hold (weights_delta). The server keeps what they hold
    (`held`, which they train from and spot checks recompute from).

    A volunteer applies the blobs in order, held += decode(delta) in float32, and holds exactly `held`.
    """

    def __init__(
        self,
        weights: Mapping[str, Tensor],
        codec: str = "topk",
        first_codec: str = "int4",
        block_size: int | None = None,
        keep: int | None = None,
    ) -> None:
        self.first = encode(weights, first_codec, default_block_size(first_codec))
        self.held: dict[str, Tensor] = decode(self.first)[0]
        self.codec, self.keep = codec, keep
        self.block_size = block_size or default_block_size(codec)

    def delta(self, weights: Mapping[str, Tensor]) -> bytes:
        """The blob taking `held` towards `weights` (held then moves by what it carries)."""
        data, self.held = weights_delta(self.held, weights, self.codec, self.block_size, self.keep)
        return data
