"""Codecs across the language boundary: bytes made by codecs.js decode with engine.codecs and the
reverse; int8 and fp16 encodings must be bit-identical to the Python ones."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load

from tests.browser.parity import b64, tensors_from_b64

pytestmark = pytest.mark.browser
codecs = pytest.importorskip("engine.codecs")


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(3, 700, generator=gen) * torch.logspace(-6, 2, 700)  # many magnitudes
    wide[0, :300] = 0.0  # an all-zero int8 block
    return {
        "w": wide,
        "b": torch.randn(37, generator=gen),
        "ties": torch.tensor([0.5, 1.5, 2.5, -0.5, 127.0, -63.5, 1.0, 0.0]),  # round-half-even cases
        "fp16_edges": torch.tensor([65504.0, 7e4, 6e-8, 3e-8, 1e-9, -2.0**-24, 1 / 3, 1e-5]),
    }


def browser_encode(page: Any, tensors: dict[str, torch.Tensor], codec: str, block: int) -> bytes:
    encoded = page.evaluate("([t, c, b]) => harness.encode(t, c, b)", [b64(tensors), codec, block])
    return base64.b64decode(encoded)


@pytest.mark.parametrize("block", [256, 7])
def test_int8_from_browser_matches_python_bytes(harness: Any, block: int) -> None:
    tensors = sample_tensors()
    data = browser_encode(harness, tensors, "int8", block)
    raw = st_load(data)
    for name, t in tensors.items():
        q, scale = codecs.quantize_int8(t, block)
        assert torch.equal(raw[name], q), name
        assert torch.equal(raw[name + ":scale"], scale), name
    decoded, meta = codecs.decode(data)
    assert meta["codec"] == "int8" and meta["block_size"] == str(block)
    for name, t in tensors.items():
        reference, _ = codecs.decode(codecs.encode({name: t}, "int8", block))
        assert torch.equal(decoded[name], reference[name]), name


def test_fp16_from_browser_is_round_to_nearest_even(harness: Any) -> None:
    tensors = sample_tensors()
    data = browser_encode(harness, tensors, "fp16", 256)
    decoded, meta = codecs.decode(data)
    assert meta["codec"] == "fp16"
    for name, t in tensors.items():
        assert torch.equal(decoded[name], t.half().float()), name


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8"])
def test_python_bytes_decode_in_browser(harness: Any, codec: str) -> None:
    tensors = sample_tensors()
    data = codecs.encode(tensors, codec, 64)
    got = tensors_from_b64(harness.evaluate("s => harness.decode(s)", base64.b64encode(data).decode()))
    want, _ = codecs.decode(data)
    for name in tensors:
        assert torch.equal(got[name], want[name]), name


def test_integer_shards_decode_in_browser(harness: Any) -> None:
    """Shards carry labels as I32 (and older ones as I64); both arrive as exact integers."""
    y32 = torch.arange(-5, 300, dtype=torch.int32)
    y64 = torch.arange(-5, 300, dtype=torch.int64)
    page_result = harness.evaluate(
        """s => { const d = crowdtrain.codecs.decode(Uint8Array.from(atob(s), c => c.charCodeAt(0)));
                  return {a: Array.from(d.a.data), b: Array.from(d.b.data),
                          t: d.a.data.constructor.name}; }""",
        base64.b64encode(codecs.encode({"a": y32, "b": y64})).decode())
    assert page_result["t"] == "Int32Array"
    assert page_result["a"] == y32.tolist() and page_result["b"] == y64.tolist()
