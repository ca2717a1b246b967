"""Codecs: exact/rounded round trips, the int8 block layout, validation and error feedback."""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.codecs import CodecError, ErrorFeedback, decode, encode


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"fc1.weight": torch.randn(7, 100, generator=g) * 3, "fc1.bias": torch.randn(7, generator=g),
            "zeros": torch.zeros(300)}


def test_fp32_round_trip_is_exact_with_metadata() -> None:
    tensors = _tensors()
    out, meta = decode(encode(tensors, metadata={"round": "3"}))
    assert meta == {"codec": "fp32", "block_size": "256", "round": "3"}
    assert out.keys() == tensors.keys()
    assert all(torch.equal(out[k], v) and out[k].dtype == torch.float32 for k, v in tensors.items())


def test_fp16_round_trip_equals_half_precision_rounding() -> None:
    tensors = _tensors()
    data = encode(tensors, "fp16")
    assert all(t.dtype == torch.float16 for t in st_load(data).values())
    out, meta = decode(data)
    assert meta["codec"] == "fp16"
    for k, v in tensors.items():
        assert out[k].dtype == torch.float32 and torch.equal(out[k], v.half().float())


@pytest.mark.parametrize("block_size", [1, 64, 256, 1000])
def test_int8_layout_and_error_bound(block_size: int) -> None:
    tensors = _tensors()
    data = encode(tensors, "int8", block_size=block_size)
    raw = st_load(data)
    w = tensors["fc1.weight"]
    assert raw["fc1.weight"].dtype == torch.int8 and raw["fc1.weight"].shape == w.shape
    scales = raw["fc1.weight:scale"]
    assert scales.dtype == torch.float32 and scales.shape == (math.ceil(w.numel() / block_size),)
    # The documented meaning: value = int8 * scale of its block of the flattened tensor.
    manual = raw["fc1.weight"].reshape(-1).float() * scales.repeat_interleave(block_size)[: w.numel()]
    out, meta = decode(data)
    assert meta == {"codec": "int8", "block_size": str(block_size)}
    assert torch.equal(out["fc1.weight"], manual.reshape(w.shape))
    flat = w.reshape(-1)
    pad = (-flat.numel()) % block_size
    absmax = torch.cat([flat, flat.new_zeros(pad)]).abs().reshape(-1, block_size).amax(1)
    torch.testing.assert_close(scales, absmax / 127)
    bound = scales.repeat_interleave(block_size)[: flat.numel()] / 2 + 1e-6
    assert bool(((out["fc1.weight"].reshape(-1) - flat).abs() <= bound).all())
    assert torch.equal(out["zeros"], tensors["zeros"])


def test_integer_tensors_pass_through_every_codec() -> None:
    labels = np.arange(10, dtype=np.int32)
    tokens = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    for codec in ("fp32", "fp16", "int8"):
        out, _ = decode(encode({"y": labels, "ids": tokens, "x": np.ones(3, np.float32)}, codec))
        assert out["y"].dtype == torch.int32 and out["y"].tolist() == labels.tolist()
        assert out["ids"].dtype == torch.int64 and torch.equal(out["ids"], tokens)
        assert out["x"].dtype == torch.float32


def test_encode_rejects_unknown_codec_and_name_collisions() -> None:
    with pytest.raises(CodecError, match="unknown codec"):
        encode({"a": torch.ones(2)}, "int4")
    with pytest.raises(CodecError, match="collides"):
        encode({"a": torch.ones(2), "a:scale": torch.ones(1)}, "int8")


def _raw(tensors: dict[str, torch.Tensor], **meta: str) -> bytes:
    return bytes(st_save(tensors, metadata=meta))


GARBAGE = [
    b"",
    b"\x00" * 4,
    b"garbage that is not safetensors at all",
    struct.pack("<Q", 10**12) + b"{}",
    struct.pack("<Q", 2) + b"{[",
    pickle.dumps({"a": torch.ones(2)}),
    _raw({"a": torch.ones(2)})[:-3],
]


@pytest.mark.parametrize("data", GARBAGE)
def test_garbage_raises_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode(data)


def test_decode_never_unpickles(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode must not unpickle")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(torch, "load", boom)
    with pytest.raises(CodecError):
        decode(pickle.dumps([1, 2, 3]))
    assert decode(encode(_tensors(), "int8"))[1]["codec"] == "int8"


q = torch.tensor([1, -2, 3], dtype=torch.int8)
INVALID = [
    ("unknown codec", _raw({"a": torch.ones(2)}, codec="zip", block_size="256"), "unknown codec"),
    ("missing scale", _raw({"a": q}, codec="int8", block_size="2"), "missing or malformed"),
    ("wrong scale count", _raw({"a": q, "a:scale": torch.ones(1)}, codec="int8", block_size="2"),
     "missing or malformed"),
    ("nan scale", _raw({"a": q, "a:scale": torch.tensor([1.0, math.nan])}, codec="int8", block_size="2"),
     "non-finite"),
    ("inf scale", _raw({"a": q, "a:scale": torch.tensor([math.inf])}, codec="int8", block_size="256"),
     "non-finite"),
    ("bad block size", _raw({"a": q, "a:scale": torch.ones(1)}, codec="int8", block_size="-1"),
     "block_size"),
    ("int8 in fp32 blob", _raw({"a": q}, codec="fp32", block_size="256"), "int8 tensors"),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_encodings_are_rejected(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(data)


def test_valid_handwritten_int8_blob_decodes() -> None:
    data = _raw({"a": q, "a:scale": torch.tensor([0.5, 2.0])}, codec="int8", block_size="2")
    out, _ = decode(data)
    assert out["a"].tolist() == [0.5, -1.0, 6.0]
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    assert header["__metadata__"] == {"codec": "int8", "block_size": "2"}


def test_error_feedback_keeps_what_quantisation_lost() -> None:
    g = torch.Generator().manual_seed(0)
    feedback = ErrorFeedback("int8", block_size=64)
    updates = [{"w": torch.randn(500, generator=g) * 10 ** -(i % 3)} for i in range(20)]
    sent_total = torch.zeros(500)
    residual = torch.zeros(500)
    for update in updates:
        data = feedback.compress(update)
        sent = decode(data)[0]["w"]
        # residual = (update + previous residual) - what was sent
        torch.testing.assert_close(feedback.residual["w"], update["w"] + residual - sent)
        residual = feedback.residual["w"]
        sent_total += sent
    true_total = sum(u["w"] for u in updates)
    # Telescoping: everything not sent yet is exactly the current residual.
    torch.testing.assert_close(sent_total + feedback.residual["w"], true_total, atol=1e-4, rtol=1e-5)
    plain = sum(decode(encode(u, "int8", 64))[0]["w"] for u in updates)
    assert (sent_total - true_total).abs().max() <= (plain - true_total).abs().max()


def test_random_corruption_only_ever_raises_codec_error() -> None:
    import random

    rng = random.Random(0)
    blobs = [encode({"a": torch.randn(300), "b": torch.arange(5)}, c, 64) for c in ("fp32", "fp16", "int8")]
    for _ in range(1000):
        data = bytearray(rng.choice(blobs))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            if rng.random() < 0.7:
                data[pos] = rng.randrange(256)
            else:
                del data[pos : pos + rng.randint(1, 20)]
        with contextlib.suppress(CodecError):
            decode(bytes(data))
