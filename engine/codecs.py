"""Tensor codecs over safetensors (docs/protocol.md "Tensors"): fp32, fp16 and blockwise int8.

Decoding only ever parses safetensors (a JSON header plus raw little-endian arrays), so bytes from
volunteers can never execute code; everything is validated and garbage raises CodecError.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
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


class CodecError(ValueError):
    """Bytes that are not a valid encoding (garbage, unknown codec, missing/bad scales)."""


def _as_tensor(value: Tensor | np.ndarray) -> Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, Tensor):
        return value.detach().cpu()
    raise CodecError(f"expected a tensor or numpy array, got {type(value).__name__}")


def quantize_int8(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """(int8 values with x's shape, one float32 absmax/127 scale per block of the flat tensor)."""
    flat = x.detach().float().reshape(-1)
    blocks = math.ceil(flat.numel() / block_size)
    padded = torch.zeros(blocks * block_size)
    padded[: flat.numel()] = flat
    padded = padded.view(blocks, block_size)
    scale = padded.abs().amax(dim=1) / 127.0
    # An all-zero block keeps scale 0; divide by 1 there to avoid 0/0.
    q = torch.round(padded / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8).reshape(-1)[: flat.numel()].reshape(x.shape), scale


def dequantize_int8(q: Tensor, scale: Tensor, block_size: int) -> Tensor:
    flat = q.reshape(-1).float()
    per_element = scale.float().repeat_interleave(block_size)[: flat.numel()]
    return (flat * per_element).reshape(q.shape)


def _encode_one(name: str, t: Tensor, codec: str, block_size: int, out: dict[str, Tensor]) -> None:
    if not t.is_floating_point():
        out[name] = t.contiguous().clone()  # labels/token ids travel unchanged
    elif codec == "fp32":
        out[name] = t.float().contiguous().clone()
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
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r} (expected one of {list(CODECS)})")
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"block_size must be in 1..{MAX_BLOCK_SIZE}")
    out: dict[str, Tensor] = {}
    for name, value in tensors.items():
        entries: dict[str, Tensor] = {}
        _encode_one(name, _as_tensor(value), codec, block_size, entries)
        if any(key in out for key in entries):
            raise CodecError(f"tensor '{name}' collides with a '{SCALE_SUFFIX}' scale entry")
        out.update(entries)
    meta = {**(metadata or {}), "codec": codec, "block_size": str(block_size)}
    return bytes(st_save(out, metadata=meta))


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


def check_header_length(prefix: bytes, max_header: int = MAX_HEADER) -> int:
    """The header length declared by a safetensors file's first 8 bytes, if at most ``max_header``:
    callers holding a file can refuse a huge header before reading the rest."""
    if len(prefix) < 8:
        raise CodecError("not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", prefix[:8])
    if size > max_header:
        raise CodecError(f"safetensors header of {size:,} bytes (at most {max_header:,})")
    return int(size)


def _read_header(data: bytes, max_header: int) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the size of the byte buffer after it; the length field is checked
    before anything is parsed, so a huge declared header costs nothing."""
    size = check_header_length(data, max_header)
    if size > len(data) - 8:
        raise CodecError("not a safetensors file (bad header length)")
    try:
        header = json_loads_bounded(data[8 : 8 + size])
    except ValueError as exc:  # includes UnicodeDecodeError
        raise CodecError(f"not a safetensors file (bad header: {str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise CodecError("not a safetensors file (the header is not an object)")
    return header, len(data) - 8 - size


def _read_metadata(header: Mapping[str, Any]) -> dict[str, str]:
    meta = header.get("__metadata__", {})
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
    names = [name for name in header if name != "__metadata__"]
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


def _decode_int8(raw: dict[str, Tensor], block_size: int) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in raw:
            continue
        if t.dtype != torch.int8:
            out[name] = _plain(name, t)
            continue
        scale = raw.get(name + SCALE_SUFFIX)
        blocks = math.ceil(t.numel() / block_size)
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (blocks,):
            raise CodecError(f"tensor '{name}': missing or malformed '{name}{SCALE_SUFFIX}'")
        if not bool(torch.isfinite(scale).all()):
            raise CodecError(f"tensor '{name}': non-finite scales")
        out[name] = dequantize_int8(t, scale, block_size)
    return out


def _plain(name: str, t: Tensor) -> Tensor:
    if t.is_floating_point():
        return t.float()
    if t.dtype in (torch.int32, torch.int64, torch.uint8, torch.int16, torch.bool):
        return t
    raise CodecError(f"tensor '{name}': unexpected dtype {t.dtype}")


def decode(data: bytes, max_header: int = MAX_HEADER) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors (floats as float32, integers unchanged) and the metadata of an encoded blob.

    Hostile bytes only ever raise CodecError: the header's size, nesting and every entry's dtype, shape
    and offsets are checked before anything is allocated, and whatever else goes wrong is wrapped.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("expected bytes")
    try:
        return _decode(bytes(data), max_header)
    except CodecError:
        raise
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        OverflowError,
        RuntimeError,
        RecursionError,
        MemoryError,
    ) as exc:
        raise CodecError(f"invalid safetensors data ({type(exc).__name__}: {str(exc)[:200]})") from None


def _decode(data: bytes, max_header: int) -> tuple[dict[str, Tensor], dict[str, str]]:
    header, buffer = _read_header(data, max_header)
    meta = _read_metadata(header)
    codec = meta.get("codec", "fp32")
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec[:20]!r}")
    block_size = _parse_block_size(meta)
    _check_entries(header, buffer)
    try:
        raw = st_load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise CodecError(f"invalid safetensors data: {exc}") from None
    if codec == "int8":
        return _decode_int8(raw, block_size), meta
    if any(t.dtype == torch.int8 for t in raw.values()):
        raise CodecError(f"int8 tensors in a {codec} blob")
    return {name: _plain(name, t) for name, t in raw.items()}, meta


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
