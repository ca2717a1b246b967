"""Aggregation rules and update checks, checked against numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from engine.aggregate import check_update, coordinate_median, trimmed_mean, weighted_mean


def _updates(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(n)]


def test_weighted_mean() -> None:
    updates, weights = _updates(3), [1.0, 2.0, 5.0]
    out = weighted_mean(updates, weights)
    for k in ("w", "b"):
        expected = sum(u[k] * w for u, w in zip(updates, weights, strict=True)) / 8
        torch.testing.assert_close(out[k], expected)
    with pytest.raises(ValueError):
        weighted_mean(updates, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        weighted_mean(updates, [1.0, math.nan, 1.0])


def test_trimmed_mean_matches_numpy_and_ignores_outliers() -> None:
    updates = _updates(7)
    updates[3] = {"w": torch.full((3, 4), 1e6), "b": torch.full((4,), -1e6)}
    out = trimmed_mean(updates, 0.2)  # drops 1 from each end
    for k in ("w", "b"):
        arr = np.sort(np.stack([u[k].numpy() for u in updates]), axis=0)[1:-1].mean(axis=0)
        np.testing.assert_allclose(out[k].numpy(), arr, rtol=1e-6, atol=1e-6)
        assert out[k].abs().max() < 10
    torch.testing.assert_close(trimmed_mean(updates[:3], 0.0)["w"], weighted_mean(updates[:3], [1] * 3)["w"])


@pytest.mark.parametrize("n", [4, 5])
def test_coordinate_median_matches_numpy(n: int) -> None:
    updates = _updates(n, seed=n)
    out = coordinate_median(updates)
    for k in ("w", "b"):
        expected = np.median(np.stack([u[k].numpy() for u in updates]), axis=0)
        np.testing.assert_allclose(out[k].numpy(), expected, rtol=1e-6, atol=1e-7)


def test_aggregators_reject_mismatched_names() -> None:
    with pytest.raises(ValueError):
        coordinate_median([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(ValueError):
        trimmed_mean([], 0.1)


def test_check_update() -> None:
    expected = {"w": (3, 4), "b": (4,)}
    good = _updates(1)[0]
    assert check_update(good, expected) is None
    assert "missing ['b']" in str(check_update({"w": good["w"]}, expected))
    assert "unexpected ['c']" in str(check_update({**good, "c": torch.ones(1)}, expected))
    assert "shape" in str(check_update({**good, "b": torch.ones(5)}, expected))
    assert "NaN" in str(check_update({**good, "b": torch.tensor([1.0, math.nan, 0, 0])}, expected))
    assert "NaN or infinite" in str(
        check_update({**good, "b": torch.tensor([1.0, math.inf, 0, 0])}, expected)
    )
    assert "float" in str(check_update({**good, "b": torch.ones(4, dtype=torch.int64)}, expected))


# --- streaming: one sum, not every update (issue 15) ----------------------------------------------------

from engine import codecs  # noqa: E402
from engine.aggregate import WeightedSum  # noqa: E402


@pytest.mark.parametrize("codec", ["int8", "fp16", "fp32", "int4", "topk", None])
def test_a_weighted_sum_equals_the_weighted_mean(codec: str | None) -> None:
    """Folded in one at a time, as blobs (int8 and int4 dequantized straight into the sum, topk's values added
    at their positions) or decoded tensors."""
    updates, weights = _updates(5, seed=7), [64.0, 50.0, 1.0, 0.0, 13.5]
    block = 6 if codec == "int4" else 5
    keep = 2 if codec == "topk" else None
    blobs = [codecs.encode(u, codec, block_size=block, keep=keep) for u in updates] if codec else []
    folded = [codecs.parse(data) for data in blobs] if codec else updates
    decoded = [codecs.decode(data)[0] for data in blobs] if codec else updates
    streaming = WeightedSum(["w", "b"])
    for update, weight in zip(folded, weights, strict=True):
        streaming.add(update, weight)
    assert streaming.count == 5 and streaming.total == sum(weights)
    expected = weighted_mean(decoded, weights)
    for name, value in streaming.mean().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6)


def test_a_weighted_sum_refuses_what_the_weighted_mean_refuses() -> None:
    update = _updates(1)[0]
    streaming = WeightedSum(["w", "b"])
    with pytest.raises(ValueError, match="no updates"):
        streaming.mean()
    for weight in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="weight"):
            streaming.add(update, weight)
    with pytest.raises(ValueError, match="no \\['b'\\]"):
        streaming.add({"w": update["w"]}, 1.0)
    shaped = WeightedSum(["w"])
    shaped.add({"w": torch.ones(3)}, 1.0)
    for other in ({"w": torch.ones(1)}, codecs.parse(codecs.encode({"w": torch.ones(2)}, "int8"))):
        with pytest.raises(ValueError, match="shape"):
            shaped.add(other, 1.0)
    streaming.add(update, 0.0)
    with pytest.raises(ValueError, match="sum to zero"):
        streaming.mean()


def test_check_update_reads_a_blob_as_it_reads_decoded_tensors() -> None:
    """Names, shapes, dtypes and finite values from the header and the scales: the same verdicts."""
    expected = {"w": (3, 4), "b": (4,)}
    good = _updates(1)[0]
    big = torch.tensor([3e38], dtype=torch.float32)
    overflow = {"w": torch.full((3, 4), 127, dtype=torch.int8), "w:scale": big, "b": torch.ones(4)}
    cases = [
        codecs.encode(good, "int8"),
        codecs.encode({"w": good["w"]}, "int8"),
        codecs.encode({**good, "b": torch.ones(5)}, "int8"),
        codecs.encode({**good, "b": torch.ones(4, dtype=torch.int64)}, "int8"),
        codecs.encode({**good, "b": torch.tensor([1.0, math.inf, 0, 0])}, "fp32"),
        bytes(
            st_save(
                {k: v.contiguous() for k, v in overflow.items()},
                metadata={"codec": "int8", "block_size": "12"},
            )
        ),
    ]
    verdicts = [check_update(codecs.parse(data), expected) for data in cases]
    assert verdicts == [check_update(codecs.decode(data)[0], expected) for data in cases]
    assert verdicts[0] is None and all(verdicts[1:])
    assert "NaN or infinite" in str(verdicts[-1])


@pytest.mark.parametrize("codec", ["int4", "topk"])
def test_check_update_reads_int4_and_topk_blobs_as_decoded_tensors(codec: str) -> None:
    expected = {"w": (3, 4), "b": (4,)}
    good = _updates(1)[0]
    cases = [
        codecs.encode(good, codec),
        codecs.encode({"w": good["w"]}, codec),
        codecs.encode({**good, "b": torch.ones(5)}, codec),
        codecs.encode({**good, "w": torch.ones(4, 3)}, codec),  # the same elements, another shape
        codecs.encode({**good, "b": torch.ones(4, dtype=torch.int64)}, codec),
    ]
    verdicts = [check_update(codecs.parse(data), expected) for data in cases]
    assert verdicts == [check_update(codecs.decode(data)[0], expected) for data in cases]
    assert verdicts[0] is None and all(verdicts[1:])
