"""Tensor codecs over safetensors (docs/protocol.md "Tensors"): fp32, fp16 and blockwise int8.

Decoding only ever parses safetensors (a JSON header plus raw little-endian arrays), so bytes from
volunteers can never execute code; everything is validated and garbage raises CodecError.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

CODECS = ("fp32", "fp16", "int8")
SCALE_SUFFIX = ":scale"
MAX_BLOCK_SIZE = 1 << 20
MAX_HEADER = 100_000_000


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


def encode(tensors: Mapping[str, Tensor | np.ndarray], codec: str = "fp32",
           block_size: int = 256, metadata: Mapping[str, str] | None = None) -> bytes:
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


def _read_metadata(data: bytes) -> dict[str, str]:
    # safetensors.torch.load gives no metadata for in-memory bytes, so read the header ourselves.
    if len(data) < 8:
        raise CodecError("not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(len(data) - 8, MAX_HEADER):
        raise CodecError("not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8 : 8 + size])
    except (ValueError, UnicodeDecodeError):
        raise CodecError("not a safetensors file (bad header)") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CodecError("bad safetensors metadata")
    return meta


def _parse_block_size(meta: Mapping[str, str]) -> int:
    raw = meta.get("block_size", "256")
    if not raw.isdigit() or not 0 < int(raw) <= MAX_BLOCK_SIZE:
        raise CodecError(f"bad block_size {raw!r}")
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


def decode(data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors (floats as float32, integers unchanged) and the metadata of an encoded blob."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("expected bytes")
    data = bytes(data)
    meta = _read_metadata(data)
    codec = meta.get("codec", "fp32")
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    block_size = _parse_block_size(meta)
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
        corrected = {name: t.detach().float() + self.residual.get(name, 0.0)
                     for name, t in update.items()}
        data = encode(corrected, self.codec, self.block_size)
        sent, _ = decode(data)
        self.residual = {name: corrected[name] - sent[name] for name in corrected}
        return data
