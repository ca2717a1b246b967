"""Activations and their gradients on the wire (pipeline mode; docs/pipeline.md "Compressed activations").

A stage's output activation, and the gradient sent back for it, travel between volunteers and the server
as immutable, content-addressed blobs: safetensors bytes as engine/codecs.py writes them, holding one
tensor named after its kind ("activation" or "gradient"). Three codecs, each with an error budget
(error_bound) that the tests hold them to:

- fp32: exact.
- fp16: the tensor is first multiplied by a power of two, 2**exponent (kept in the metadata), that puts
  its largest magnitude in [2**14, 2**15), then rounded to half. Plain fp16 would flush activation
  gradients, often below fp16's smallest normal 2**-14 = 6.1e-5, to zero. Scaling by a power of two is exact
  in float32, so every element keeps a relative error of at most 2**-11 = 4.9e-4 down to 2**-28 of the
  tensor's largest magnitude: error <= 2**-11 |x| + 2**-39 max|x| (+ 2**-149, float32's subnormal step).
- int8: engine/codecs.py's blockwise int8, one absmax/127 scale per block of the flattened tensor
  (block_size = the row length gives per-row scales): error <= half a step, s/2 = absmax/254 of the
  element's block, plus float32 rounding (2**-22 of the block's absmax, and 2**-142 for blocks so small
  that their scale is a float32 subnormal).

frontend/static/engine/activations.js is the browser's twin: the same tensors give the same bytes.
Decoding is for hostile bytes (from peers and volunteers): the caller states the shape it expects, and
anything else (another shape, dtype, kind or codec, extra tensors or metadata, a header over MAX_HEADER,
non-finite values) raises ActivationError. spot_check compares a volunteer's decoded blob with the
server's recomputation of the unit: within the budget plus the parity tolerance, with an allowance for
max-pool ties in gradients. Plain module: no Django.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine import codecs

CODECS = ("fp32", "fp16", "int8")
KINDS = ("activation", "gradient")  # the blob's one tensor is named after its kind
DEFAULT_BLOCK = 256
MAX_HEADER = 4096  # one tensor, its scales and three metadata entries need a few hundred bytes
EXPONENT = "exponent"  # fp16 metadata: the values were multiplied by 2**exponent before rounding
HALF_TOP = 14  # fp16: the largest magnitude is scaled into [2**14, 2**15), clear of fp16's max 65504
# Compressed codecs refuse magnitudes from 2**127 (float32's top octave): their decoded values could round
# past float32's maximum. Below that, max|x| maps to an exponent from 14 - 126 up; 2**127 is the largest
# float32 multiplier, so a tensor below 2**-113 is scaled no further (its error stays below 2**-149).
COMPRESSED_LIMIT = 2.0**127
MIN_EXPONENT, MAX_EXPONENT = HALF_TOP - 126, 127
STORED_DTYPES = {"fp32": "F32", "fp16": "F16", "int8": "I8"}
METADATA_KEYS = {"codec", "block_size", EXPONENT}
FP16_RELATIVE = 2.0**-11  # half a unit in the last place of fp16's 11-bit significand
FP16_FLOOR = 2.0**-25  # half of fp16's smallest subnormal, in the scaled units
FLOAT32_TINY = 2.0**-149  # float32's smallest subnormal: the rounding of a decoded subnormal
INT8_ROUNDING = 2.0**-22  # float32 rounding of the scale, x / scale and q * scale, relative to the absmax
INT8_SUBNORMAL = 2.0**-142  # the same roundings where the scale is a float32 subnormal (absmax < 1.5e-36)
# spot_check: the share of a gradient's elements a max-pool tie may route elsewhere (measured: at most 0.93%,
# ResNet-18's stem pool reading an int8 stage input; docs/pipeline.md)
TIE_SHARE = 0.02
SUM_SIGMAS = 8.0


class ActivationError(ValueError):
    """A tensor that cannot be sent, or bytes that are not the activation blob expected."""


def encode(
    x: Tensor | np.ndarray,
    codec: str = "fp16",
    *,
    kind: str = "activation",
    block_size: int = DEFAULT_BLOCK,
) -> bytes:
    """The blob of one activation (or activation gradient) under ``codec``; non-finite values refused."""
    _check_choice("codec", codec, CODECS)
    _check_choice("kind", kind, KINDS)
    t = _finite_float32(x)
    if codec != "fp32" and t.numel() and float(t.abs().max()) >= COMPRESSED_LIMIT:
        raise ActivationError(f"magnitudes of 2**127 or more cannot be sent as {codec} (fp32 can)")
    if codec != "fp16":
        return codecs.encode({kind: t}, codec, block_size)
    exponent = half_exponent(t)
    scaled = t * 2.0**exponent  # a power of two: exact in float32
    return codecs.encode({kind: scaled}, "fp16", block_size, {EXPONENT: str(exponent)})


def decode(
    data: bytes | bytearray | memoryview,
    shape: Sequence[int],
    *,
    kind: str = "activation",
    codec: str | None = None,
) -> Tensor:
    """The float32 tensor of a blob that must hold exactly one ``kind`` tensor of ``shape`` (and, if
    given, be encoded with ``codec``); anything else raises ActivationError."""
    _check_choice("kind", kind, KINDS)
    try:
        packed = codecs.parse(data, MAX_HEADER)
    except codecs.CodecError as exc:
        raise ActivationError(f"not an activation blob: {exc}") from None
    found = _check_blob(packed, _stored_dtypes(data), list(shape), kind, codec)
    value = packed[kind]
    if found == "fp16":
        value.mul_(2.0 ** -_exponent(packed.meta))
    if not bool(torch.isfinite(value).all()):
        raise ActivationError(f"the {kind} holds non-finite values")
    return value


def error_bound(x: Tensor, codec: str, block_size: int = DEFAULT_BLOCK) -> Tensor:
    """Per element, the most decode(encode(x, codec)) may differ from x (float64): the stated budget."""
    _check_choice("codec", codec, CODECS)
    t = _finite_float32(x).double()
    if codec == "fp32":
        return torch.zeros_like(t)
    if codec == "fp16":
        return FP16_RELATIVE * t.abs() + FP16_FLOOR * 2.0 ** -half_exponent(t) + FLOAT32_TINY
    absmax = _block_absmax(t, block_size)
    return absmax / 254 + INT8_ROUNDING * absmax + INT8_SUBNORMAL


@dataclass(frozen=True)
class Agreement:
    """A volunteer's decoded blob against the server's recomputation of the same unit (spot_check)."""

    worst: float  # the largest |sent - recomputed| over its allowance (at most 1: all within budget)
    outliers: int  # elements beyond their allowance
    share: float  # outliers over elements
    accepted: bool


def spot_check(
    sent: Tensor,
    recomputed: Tensor,
    codec: str,
    *,
    kind: str = "activation",
    block_size: int = DEFAULT_BLOCK,
    tolerance: float = 1e-4,
) -> Agreement:
    """Whether ``sent`` (a blob's decoded tensor) agrees with the server's float32 recomputation of its unit:
    every element within the codec's budget plus ``tolerance`` times the largest magnitude (the float32
    difference of TF.js and torch). A gradient may also differ on up to TIE_SHARE of its elements, each by at
    most the largest magnitude, if every sample's sum is kept: TF.js's WebGL and WASM max-pool gradients send
    a tied window's gradient to its last maximum, torch to its first (docs/pipeline.md)."""
    _check_choice("kind", kind, KINDS)
    got, want = sent.detach().double(), recomputed.detach().double()
    if got.shape != want.shape:
        raise ActivationError(f"shapes {list(got.shape)} and {list(want.shape)} differ")
    top = float(want.abs().max()) if want.numel() else 0.0
    allowed = error_bound(want, codec, block_size) + tolerance * top
    excess = (got - want).abs()
    over = excess > allowed
    outliers, count = int(over.sum()), max(want.numel(), 1)
    worst = float((excess / allowed.clamp_min(FLOAT32_TINY)).max()) if want.numel() else 0.0
    accepted = outliers == 0 or (kind == "gradient" and _ties_only(got - want, allowed, over, top))
    return Agreement(worst, outliers, outliers / count, accepted)


def _ties_only(diff: Tensor, allowed: Tensor, over: Tensor, top: float) -> bool:
    """Differences a max-pool's tie-breaking explains: few, bounded, and moved within each sample."""
    if int(over.sum()) > TIE_SHARE * diff.numel() or not bool((diff.abs() <= top + allowed)[over].all()):
        return False
    rows = diff.shape[0] if diff.dim() else 1
    moved = diff.reshape(rows, -1).sum(dim=1).abs()
    # Honest errors are independent, zero-mean and within their allowance a: by Hoeffding's inequality their
    # sum passes 8 sqrt(sum a**2) with probability below 1e-13. A tie moves gradient, it does not add any.
    spread = allowed.reshape(rows, -1).pow(2).sum(dim=1).sqrt()
    return bool((moved <= SUM_SIGMAS * spread).all())


def half_exponent(x: Tensor) -> int:
    """The power of two fp16 scales ``x`` by: its largest magnitude into [2**14, 2**15), within bounds."""
    top = float(x.detach().abs().max()) if x.numel() else 0.0
    if top == 0.0:
        return 0
    _, e = math.frexp(top)  # top = f * 2**e with 0.5 <= f < 1: floor(log2(top)) = e - 1
    return max(MIN_EXPONENT, min(MAX_EXPONENT, HALF_TOP - (e - 1)))


def digest(data: bytes | bytearray | memoryview) -> str:
    """The blob's content address (sha256, hex), as the blob store and the ring's credit records use."""
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- helpers


def _check_choice(what: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ActivationError(f"unknown {what} {str(value)[:20]!r} (one of {list(choices)})")


def _finite_float32(x: Tensor | np.ndarray) -> Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise ActivationError(f"expected a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    t = t.detach().cpu().to(torch.float32).contiguous()
    if not bool(torch.isfinite(t).all()):
        raise ActivationError("cannot send non-finite values (a diverged unit)")
    return t


def _block_absmax(t: Tensor, block_size: int) -> Tensor:
    """Each element's block absmax (blocks of the flattened tensor, as codecs.quantize_int8 has them)."""
    if not 0 < block_size <= codecs.MAX_BLOCK_SIZE:
        raise ActivationError(f"block_size must be in 1..{codecs.MAX_BLOCK_SIZE}")
    flat = t.reshape(-1).abs()
    padded = torch.zeros(math.ceil(flat.numel() / block_size) * block_size, dtype=t.dtype)
    padded[: flat.numel()] = flat
    blocks = padded.view(-1, block_size).amax(dim=1) if padded.numel() else padded
    return blocks.repeat_interleave(block_size)[: flat.numel()].reshape(t.shape)


def _stored_dtypes(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """dtype by tensor name, from a header codecs.parse has already checked (bounded by MAX_HEADER)."""
    view = memoryview(data).cast("B")
    size = codecs.check_header_length(view, MAX_HEADER)
    header = json.loads(bytes(view[8 : 8 + size]))
    return {name: info["dtype"] for name, info in header.items() if name != codecs.METADATA}


def _check_blob(
    packed: codecs.Packed, dtypes: dict[str, str], shape: list[int], kind: str, codec: str | None
) -> str:
    """The blob's codec, once its one tensor, dtype, shape and metadata are what was asked for."""
    found = packed.meta.get("codec", "")
    if "block_size" not in packed.meta or found not in CODECS or (codec is not None and found != codec):
        raise ActivationError(f"codec {found[:20]!r}, expected {codec or list(CODECS)}")
    extra = set(packed.meta) - METADATA_KEYS
    if extra or (found == "fp16") != (EXPONENT in packed.meta):
        raise ActivationError(f"unexpected metadata {sorted(packed.meta)[:5]}")
    if list(packed) != [kind]:
        raise ActivationError(f"expected one tensor '{kind}', got {[n[:40] for n in list(packed)[:5]]}")
    if dtypes[kind] != STORED_DTYPES[found]:
        raise ActivationError(f"a {found} {kind} is stored as {STORED_DTYPES[found]}, not {dtypes[kind]}")
    if list(packed.shape(kind)) != shape:
        raise ActivationError(f"the {kind} has shape {list(packed.shape(kind))[:8]}, expected {shape}")
    return found


def _exponent(meta: dict[str, str]) -> int:
    raw = meta[EXPONENT]
    digits = raw[1:] if raw.startswith("-") else raw
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 3):
        raise ActivationError(f"bad fp16 exponent {raw[:20]!r}")
    value = int(raw)
    if not MIN_EXPONENT <= value <= MAX_EXPONENT:
        raise ActivationError(f"fp16 exponent {value} outside {MIN_EXPONENT}..{MAX_EXPONENT}")
    return value
