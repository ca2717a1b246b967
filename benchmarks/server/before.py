"""The aggregation path as it was before issue 15, frozen here so that every run measures it side by side
with today's (git 186c862: engine/codecs.py, engine/aggregate.py, engine/optim.py, projects/blobs.py and
projects/services.py).

Then an update was decoded twice: by validation (to check it: names, shapes, finite values, norm) and by
training (to aggregate it), each time into a float32 copy through safetensors' loader and a per-element
scale vector; every update of a round was held decoded until a weighted mean over all of them; the step
allocated a new copy of the model; and publishing re-read the current weights and optimizer state from their
blobs and joined each new blob into bytes before hashing and writing it (in one write).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from engine.codecs import ITEMSIZES, SCALE_SUFFIX, CodecError, check_header_length, json_loads_bounded

Tensors = Mapping[str, Tensor]


# --- engine/codecs.py -----------------------------------------------------------------------------------


def quantize_int8(x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    flat = x.detach().float().reshape(-1)
    blocks = math.ceil(flat.numel() / block_size)
    padded = torch.zeros(blocks * block_size)
    padded[: flat.numel()] = flat
    padded = padded.view(blocks, block_size)
    scale = padded.abs().amax(dim=1) / 127.0
    q = torch.round(padded / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8).reshape(-1)[: flat.numel()].reshape(x.shape), scale


def dequantize_int8(q: Tensor, scale: Tensor, block_size: int) -> Tensor:
    flat = q.reshape(-1).float()
    per_element = scale.float().repeat_interleave(block_size)[: flat.numel()]
    return (flat * per_element).reshape(q.shape)


def encode(tensors: Mapping[str, Tensor], codec: str = "fp32", block_size: int = 256) -> bytes:
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if not t.is_floating_point():
            out[name] = t.contiguous().clone()
        elif codec == "fp32":
            out[name] = t.float().contiguous().clone()
        elif codec == "fp16":
            out[name] = t.half().contiguous()
        else:
            out[name], out[name + SCALE_SUFFIX] = quantize_int8(t, block_size)
    return bytes(st_save(out, metadata={"codec": codec, "block_size": str(block_size)}))


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**62


def _check_entry(name: str, info: Any, buffer: int) -> None:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CodecError(f"tensor {name!r}: a header entry needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZES:
        raise CodecError(f"tensor {name!r}: unsupported dtype")
    if not isinstance(shape, list) or len(shape) > 16 or not all(_is_size(d) for d in shape):
        raise CodecError(f"tensor {name!r}: bad shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)):
        raise CodecError(f"tensor {name!r}: bad data_offsets")
    begin, end = offsets
    if not begin <= end <= buffer or end - begin != math.prod(shape) * ITEMSIZES[dtype]:
        raise CodecError(f"tensor {name!r}: does not fit")


def decode(data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    data = bytes(data)
    size = check_header_length(data)
    header = json_loads_bounded(data[8 : 8 + size])
    meta = header.get("__metadata__", {})
    block_size = int(meta.get("block_size", "256"))
    for name, info in header.items():
        if name != "__metadata__":
            _check_entry(name, info, len(data) - 8 - size)
    raw = st_load(data)
    if meta.get("codec") != "int8":
        return {name: t.float() if t.is_floating_point() else t for name, t in raw.items()}, meta
    out: dict[str, Tensor] = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in raw:
            continue
        if t.dtype != torch.int8:
            out[name] = t.float() if t.is_floating_point() else t
            continue
        scale = raw[name + SCALE_SUFFIX]
        if not bool(torch.isfinite(scale).all()):
            raise CodecError(f"tensor '{name}': non-finite scales")
        out[name] = dequantize_int8(t, scale, block_size)
    return out, meta


# --- engine/aggregate.py and projects/validation.py -------------------------------------------------------


def weighted_mean(updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, Tensor]:
    total = float(sum(weights))
    return {
        n: sum(
            (u[n].float() * (w / total) for u, w in zip(updates, weights, strict=True)),
            torch.zeros_like(updates[0][n], dtype=torch.float32),
        )
        for n in updates[0]
    }


def check_update(update: Tensors, expected: Mapping[str, tuple[int, ...]]) -> str | None:
    missing, extra = sorted(set(expected) - set(update)), sorted(set(update) - set(expected))
    if missing or extra:
        return f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}"
    for name, shape in expected.items():
        t = update[name]
        if tuple(t.shape) != tuple(shape):
            return f"'{name}' has shape {tuple(t.shape)}, expected {tuple(shape)}"
        if not t.is_floating_point():
            return f"'{name}' is not a float tensor ({t.dtype})"
        if not bool(torch.isfinite(t).all()):
            return f"'{name}' contains NaN or infinite values"
    return None


def norm(update: Tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in update.values()))


# --- engine/optim.py ----------------------------------------------------------------------------------


def sgd_step(
    params: Tensors, grads: Tensors, state: Tensors, lr: float, momentum: float, weight_decay: float = 0.0
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    new_params, new_state = dict(params), dict(state)
    for name, grad in grads.items():
        p = params[name]
        d_p = grad.add(p, alpha=weight_decay) if weight_decay else grad.clone()
        if momentum:
            key = f"momentum_buffer:{name}"
            buf = state.get(key)
            buf = d_p.clone() if buf is None else buf.mul(momentum).add_(d_p)
            new_state[key] = buf
            d_p = buf
        new_params[name] = p.add(d_p, alpha=-lr)
    return new_params, new_state


# --- projects/models.py, projects/blobs.py and projects/services.py --------------------------------------


def read(blob: Any) -> bytes:
    return bytes(Path(blob.path).read_bytes())


def blob_put(*, data: bytes) -> Any:
    from django.conf import settings
    from django.db import transaction
    from django.utils import timezone

    from projects.models import Blob

    sha = hashlib.sha256(data).hexdigest()
    with transaction.atomic():
        row = Blob(sha256=sha, size=len(data), stored_at=timezone.now())
        Blob.objects.bulk_create(
            [row], update_conflicts=True, unique_fields=["sha256"], update_fields=["stored_at"]
        )
        _write_file(path=Path(settings.BLOB_ROOT) / sha[:2] / sha, data=data)
        return Blob.objects.get(pk=sha)


def _write_file(*, path: Path, data: bytes) -> None:
    try:
        os.utime(path)
        return
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def version_publish(
    *, project: Any, number: int, weights: Tensors, momentum: Tensors, samples: int, wire_codec: str
) -> Any:
    from projects.models import ModelVersion

    return ModelVersion.objects.create(
        project=project,
        number=number,
        weights=blob_put(data=encode(weights)),
        optimizer_state=blob_put(data=encode(momentum)) if momentum else None,
        wire_weights=blob_put(data=encode(weights, wire_codec)) if wire_codec != "fp32" else None,
        samples=samples,
    )


# --- main's publish at 775d94c (after the rest of issue 15, before the publish work) -----------------------
#
# The step in place on this process's copy of the weights and momentum, then the weights and the momentum
# each hashed and written from the tensors' memory, one after the other, before the version's row.


def blob_put_pieces(*, pieces: Sequence[memoryview]) -> Any:
    from django.conf import settings
    from django.db import transaction
    from django.utils import timezone

    from projects.models import Blob

    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    sha, size = digest.hexdigest(), sum(piece.nbytes for piece in pieces)
    with transaction.atomic():
        row = Blob(sha256=sha, size=size, stored_at=timezone.now())
        Blob.objects.bulk_create(
            [row], update_conflicts=True, unique_fields=["sha256"], update_fields=["stored_at"]
        )
        _write_pieces(path=Path(settings.BLOB_ROOT) / sha[:2] / sha, pieces=pieces)
        return Blob.objects.get(pk=sha)


def _write_pieces(*, path: Path, pieces: Sequence[memoryview]) -> None:
    try:
        os.utime(path)
        return
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as handle:
        for piece in pieces:
            view = piece.cast("B")
            for start in range(0, len(view), 1 << 18):
                handle.write(view[start : start + (1 << 18)])
    os.replace(tmp, path)


def version_publish_main(
    *, project: Any, number: int, weights: Tensors, momentum: Tensors, samples: int, wire_codec: str
) -> Any:
    from engine.codecs import encode_parts
    from projects.models import ModelVersion

    wire = blob_put_pieces(pieces=encode_parts(weights, wire_codec)) if wire_codec != "fp32" else None
    return ModelVersion.objects.create(
        project=project,
        number=number,
        weights=blob_put_pieces(pieces=encode_parts(weights)),
        optimizer_state=blob_put_pieces(pieces=encode_parts(momentum)) if momentum else None,
        wire_weights=wire,
        samples=samples,
    )
