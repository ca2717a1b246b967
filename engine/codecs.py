"""Tensor codecs over safetensors (docs/protocol.md "Tensors"): fp32, fp16 and blockwise int8.

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

CODECS = ("fp32", "fp16", "int8")
SCALE_SUFFIX = ":scale"
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


def quantize_int8(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """(int8 values with x's shape, one float32 absmax/127 scale per block of the flat tensor): per block,
    round(x / scale) (x / 1 for an all-zero block, whose scale stays 0), a cache-sized chunk at a time."""
    flat = x.detach().float().reshape(-1)
    q, scale = torch.empty(flat.shape, dtype=torch.int8), torch.empty(math.ceil(flat.numel() / block_size))
    (x_full, x_rest), (q_full, q_rest) = _rows(flat, block_size), _rows(q, block_size)
    full, rows = x_full.shape[0], max(1, CHUNK // block_size)
    scratch, s_full = _scratch(min(full, rows) * block_size).view(-1, block_size), scale[:full]
    for first in range(0, full, rows):
        values = scratch if first + rows <= full else scratch[: full - first]
        _quantize_rows(
            x_full[first : first + rows], values, q_full[first : first + rows], s_full[first : first + rows]
        )
    if x_rest.numel():
        _quantize_rows(x_rest, torch.empty(x_rest.shape), q_rest, scale[full:])
    return q.reshape(x.shape), scale


def _quantize_rows(x: Tensor, work: Tensor, q: Tensor, scale: Tensor) -> None:
    torch.abs(x, out=work)
    torch.amax(work, dim=1, out=scale)
    scale.div_(127.0)
    torch.div(x, torch.where(scale > 0, scale, 1.0)[:, None], out=work)
    q.copy_(work.round_().clamp_(-127, 127))


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


_local = threading.local()


def _scratch(size: int) -> Tensor:
    buffer: Tensor | None = getattr(_local, "scratch", None)
    if buffer is None or buffer.numel() < size:
        buffer = _local.scratch = torch.empty(max(size, CHUNK))
    return buffer[:size]


def _memory(t: Tensor) -> memoryview:
    """The tensor's bytes without a copy (it is contiguous)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _encode_one(name: str, t: Tensor, codec: str, block_size: int, out: dict[str, Tensor]) -> None:
    if t.dtype not in SAFETENSORS_DTYPES:
        raise CodecError(f"tensor '{name[:100]}': cannot encode {t.dtype}")
    if not t.is_floating_point():
        out[name] = t.contiguous()  # labels/token ids travel unchanged
    elif codec == "fp32":
        out[name] = t.float().contiguous()
    elif codec == "fp16":
        out[name] = t.half().contiguous()
    else:
        out[name], out[name + SCALE_SUFFIX] = quantize_int8(t, block_size)


def encode(
    tensors: Mapping[str, Tensor | np.ndarray],
    codec: str = "fp32",
    block_size: int = 256,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """safetensors bytes: the tensors (floats under `codec`) and metadata with the codec and block size."""
    return b"".join(encode_parts(tensors, codec, block_size, metadata))


def encode_parts(
    tensors: Mapping[str, Tensor | np.ndarray],
    codec: str = "fp32",
    block_size: int = 256,
    metadata: Mapping[str, str] | None = None,
) -> list[memoryview]:
    """encode's bytes in pieces, to hash and write one after the other instead of joining them: the header,
    then each tensor's own memory where it can be (float32 tensors under fp32 are not copied). The pieces
    share memory with `tensors`, so use them before changing those."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r} (expected one of {list(CODECS)})")
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"block_size must be in 1..{MAX_BLOCK_SIZE}")
    out: dict[str, Tensor] = {}
    for name, value in tensors.items():
        entries: dict[str, Tensor] = {}
        _encode_one(name, _as_tensor(value), codec, block_size, entries)
        if any(key in out or key == METADATA for key in entries):
            raise CodecError(f"tensor '{name}' collides with a '{SCALE_SUFFIX}' scale entry or the metadata")
        out.update(entries)
    meta = {**(metadata or {}), "codec": codec, "block_size": str(block_size)}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CodecError("metadata keys and values must be strings")
    return _serialized(out, meta)


def _serialized(tensors: Mapping[str, Tensor], meta: Mapping[str, str]) -> list[memoryview]:
    # The safetensors layout: tensors with the widest elements first, so every one is aligned in the file
    # (the header is padded to 8 bytes); sorted metadata, so the same tensors always give the same bytes.
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {METADATA: dict(sorted(meta.items()))}
    pieces, offset = [], 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        entry = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        header[name], offset = entry, offset + size
        pieces.append(_memory(t))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [memoryview(struct.pack("<Q", len(raw)) + raw), *pieces]


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
class _Layout:
    """A checked header: what a blob holds and where (byte offsets into the data after the header)."""

    codec: str
    block_size: int
    meta: dict[str, str]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]]  # dtype, shape, offset (scales excluded)
    scales: dict[str, int]  # an int8 tensor's name: the offset of its float32 block scales
    scale_spans: tuple[tuple[int, int], ...]  # the bytes holding every scale, adjacent ranges merged
    gathers: dict[tuple[str, ...], _Gather | None] = field(default_factory=dict)

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
    if codec != "int8":
        if any(dtype == torch.int8 for dtype, _, _ in entries.values()):
            raise CodecError(f"int8 tensors in a {codec} blob")
        return _Layout(codec, block_size, meta, entries, {}, ())
    return _int8_layout(entries, block_size, meta)


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
        return name in self._layout.scales or self._layout.tensors[name][0].is_floating_point

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
        if name not in self._layout.scales:
            out.add_(self._stored(name), alpha=weight)
            return
        for values, scales, target in _int8_steps(
            self._stored(name), self._scale(name) * weight, self.block_size, out
        ):
            target.addcmul_(values, scales)

    def _sq_norm(self, name: str) -> float:
        if name not in self._layout.scales:
            return float(torch.linalg.vector_norm(self._stored(name), dtype=torch.float64)) ** 2
        total = 0.0
        # Per block: the norm of its int8 values (exact in float32 up to 2^20 of them) times its scale.
        for values, scales, _ in _int8_steps(self._stored(name), self._scale(name), self.block_size):
            rows = torch.linalg.vector_norm(values, dim=1).double() * scales[:, 0].double()
            total += float(rows.dot(rows))
        return total

    def _decoded(self, name: str, *, copy: bool) -> Tensor:
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
        return self._slice(torch.float32, self._layout.scales[name], (blocks,))

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
        {torch.float32} if layout.scales else set()
    )
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
    for name, offset in layout.scales.items():
        blocks = math.ceil(math.prod(layout.tensors[name][1]) / layout.block_size)
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
    return Packed(regions, layout, tuple(layout.tensors), _largest_scale(regions, layout))


class ErrorFeedback:
    """Error-feedback compression: what quantisation drops from one update is added to the next,
    so over many rounds nothing is lost (the residual stays bounded instead of biasing training).
    """

    def __init__(self, codec: str = "int8", block_size: int = 256) -> None:
        self.codec, self.block_size = codec, block_size
        self.residual: dict[str, Tensor] = {}

    def compress(self, update: Mapping[str, Tensor]) -> bytes:
        corrected = {name: t.detach().float() + self.residual.get(name, 0.0) for name, t in update.items()}
        data = encode(corrected, self.codec, self.block_size)
        sent, _ = decode(data)
        self.residual = {name: corrected[name] - sent[name] for name in corrected}
        return data
