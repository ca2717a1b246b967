"""Codecs across the language boundary: bytes made by codecs.js decode with engine.codecs and the
reverse; int8 and fp16 encodings must be bit-identical to the Python ones."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load

from tests.browser.parity import b64, record, tensors_from_b64

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
        "fp16_edges": torch.tensor([65504.0, 7e4, 6e-8, 3e-8, 1e-9, -(2.0**-24), 1 / 3, 1e-5]),
    }


def browser_encode(
    page: Any, tensors: dict[str, torch.Tensor], codec: str, block: int, keep: int | None = None
) -> bytes:
    encoded = page.evaluate(
        "([t, c, b, k]) => harness.encode(t, c, b, k)", [b64(tensors), codec, block, keep]
    )
    return base64.b64decode(encoded)


@pytest.mark.parametrize(
    ("codec", "block", "keep"), [("int4", 256, None), ("int4", 6, None), ("topk", 64, 5)]
)
def test_int4_and_topk_from_browser_are_python_bytes(
    harness: Any, codec: str, block: int, keep: int | None
) -> None:
    """Byte for byte (metadata, packing, top-k choice with ties, offsets, int8 values and scales)."""
    tensors = sample_tensors()
    data = browser_encode(harness, tensors, codec, block, keep)
    assert data == codecs.encode(tensors, codec, block, keep=keep)
    got = tensors_from_b64(harness.evaluate("s => harness.decode(s)", base64.b64encode(data).decode()))
    want, _ = codecs.decode(data)
    for name in tensors:
        assert torch.equal(got[name].reshape(want[name].shape), want[name]), name


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
        base64.b64encode(codecs.encode({"a": y32, "b": y64})).decode(),
    )
    assert page_result["t"] == "Int32Array"
    assert page_result["a"] == y32.tolist() and page_result["b"] == y64.tolist()


# ---- error feedback ------------------------------------------------------------------------------
EF_STEPS, EF_BLOCK = 8, 64

# Runs codecs.js's ErrorFeedback over a list of updates (fp32 safetensors, base64): every step's bytes,
# and the residual left at the end (fp32 safetensors), base64.
JS_ERROR_FEEDBACK = """([updates, codec, blockSize]) => {
  const c = crowdtrain.codecs;
  const fromB64 = (s) => Uint8Array.from(atob(s), (ch) => ch.charCodeAt(0));
  const toB64 = (bytes) => {
    let bin = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    }
    return btoa(bin);
  };
  const ef = new c.ErrorFeedback(codec, { blockSize });
  const sent = updates.map((u) => toB64(ef.compress(c.decode(fromB64(u)))));
  const residual = Object.entries(ef.residual).map(([name, data]) => ({ name, shape: [data.length], data }));
  return { sent, residual: toB64(c.encode(residual, "fp32")) };
}"""


def ef_updates() -> list[dict[str, torch.Tensor]]:
    """Updates with a steady part, so plain quantisation errors pile up step after step, plus noise."""
    gen = torch.Generator().manual_seed(9)
    steady = {
        "w": torch.randn(3, 100, generator=gen) * torch.logspace(-4, 0, 100),
        "b": torch.randn(37, generator=gen),
    }
    return [
        {k: v * (1 + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in steady.items()}
        for _ in range(EF_STEPS)
    ]


def browser_error_feedback(
    page: Any, updates: list[dict[str, torch.Tensor]], codec: str
) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    r = page.evaluate(JS_ERROR_FEEDBACK, [[b64(u) for u in updates], codec, EF_BLOCK])
    return [base64.b64decode(s) for s in r["sent"]], tensors_from_b64(r["residual"])


@pytest.mark.parametrize("codec", ["int8", "fp16", "int4", "topk"])
def test_error_feedback_matches_python(harness: Any, codec: str) -> None:
    """Same inputs: every step's bytes decode in Python to what Python's ErrorFeedback sends, and the
    residual left after all steps is Python's."""
    updates = ef_updates()
    sent, residual = browser_error_feedback(harness, updates, codec)
    reference = codecs.ErrorFeedback(codec, EF_BLOCK)
    for step, (data, update) in enumerate(zip(sent, updates, strict=True)):
        got, meta = codecs.decode(data)
        want, _ = codecs.decode(reference.compress(update))
        assert meta["codec"] == codec and meta["block_size"] == str(EF_BLOCK)
        for name in update:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=f"{name} step {step}")
    for name, t in reference.residual.items():
        torch.testing.assert_close(residual[name].reshape(t.shape), t, rtol=1e-5, atol=1e-7, msg=name)


def test_error_feedback_sum_tracks_true_updates(harness: Any) -> None:
    """The point of error feedback: summed over the steps, what was sent is within one quantisation step
    (the last step's int8 block scale) of the true sum, while quantising each update on its own drifts."""
    updates = ef_updates()
    sent, _ = browser_error_feedback(harness, updates, "int8")
    last_scales = st_load(sent[-1])
    for name in updates[0]:
        true_sum = torch.stack([u[name] for u in updates]).sum(0)
        ef_sum = torch.stack([codecs.decode(data)[0][name] for data in sent]).sum(0)
        plain_sum = torch.stack(
            [codecs.decode(codecs.encode({name: u[name]}, "int8", EF_BLOCK))[0][name] for u in updates]
        ).sum(0)
        step = codecs.dequantize_int8(
            torch.ones_like(true_sum, dtype=torch.int8), last_scales[name + ":scale"], EF_BLOCK
        )
        ef_error, plain_error = (ef_sum - true_sum).abs(), (plain_sum - true_sum).abs()
        record(
            "error_feedback",
            {
                "tensor": name,
                "ef_max_over_step": float((ef_error / step).max()),
                "plain_max_over_step": float((plain_error / step).max()),
            },
        )
        assert bool((ef_error <= step * (1 + 1e-4) + 1e-7).all()), name
        assert float(plain_error.max()) > 2 * float(ef_error.max()), name  # without feedback it drifts
