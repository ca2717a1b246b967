"""Aggregation rules and server optimizers, checked against numpy/torch references."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from engine.aggregate import (
    adam_step,
    check_update,
    coordinate_median,
    outer_nesterov_step,
    sgd_step,
    trimmed_mean,
    weighted_mean,
)


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
    assert "NaN or infinite" in str(check_update({**good, "b": torch.tensor([1.0, math.inf, 0, 0])},
                                                 expected))
    assert "float" in str(check_update({**good, "b": torch.ones(4, dtype=torch.int64)}, expected))


def _reference(opt_cls: type[torch.optim.Optimizer], steps: int, **kw: Any
               ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Grads used and final params of a real torch optimizer run."""
    start = _updates(1, seed=42)[0]
    params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    opt = opt_cls(list(params.values()), **kw)
    grads = []
    for i in range(steps):
        g = _updates(1, seed=i)[0]
        grads.append(g)
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return grads, {k: p.detach() for k, p in params.items()}


SGD_CONFIGS = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1},
]


@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_sgd_step_matches_torch(config: dict[str, float]) -> None:
    grads, expected = _reference(torch.optim.SGD, 4, **config)
    params, state = dict(_updates(1, seed=42)[0]), dict[str, torch.Tensor]()
    original = {k: v.clone() for k, v in params.items()}
    for g in grads:
        params, state = sgd_step(params, g, state, **config)  # type: ignore[arg-type]
    for k in expected:
        torch.testing.assert_close(params[k], expected[k], atol=1e-6, rtol=1e-6)
    assert all(torch.equal(_updates(1, seed=42)[0][k], v) for k, v in original.items())
    if config.get("momentum"):
        assert set(state) == {"momentum_buffer:w", "momentum_buffer:b"}


@pytest.mark.parametrize("config", [{"lr": 0.01}, {"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-6,
                                                   "weight_decay": 0.05}])
def test_adam_step_matches_torch(config: dict[str, object]) -> None:
    grads, expected = _reference(torch.optim.Adam, 5, **config)
    params, state = dict(_updates(1, seed=42)[0]), dict[str, torch.Tensor]()
    for g in grads:
        params, state = adam_step(params, g, state, **config)  # type: ignore[arg-type]
    for k in expected:
        torch.testing.assert_close(params[k], expected[k], atol=1e-6, rtol=1e-6)
    assert float(state["step:w"]) == 5


def test_adam_does_not_mutate_its_inputs() -> None:
    params, grads = _updates(1, seed=1)[0], _updates(1, seed=2)[0]
    _, state = adam_step(params, grads, {}, lr=0.1)
    frozen = {k: v.clone() for k, v in state.items()}
    adam_step(params, grads, state, lr=0.1)
    assert all(torch.equal(frozen[k], state[k]) for k in frozen)


def test_outer_nesterov_step() -> None:
    before = _updates(1, seed=3)[0]
    locals_ = [{k: v - 0.1 * d[k] for k, v in before.items()} for d in _updates(4, seed=4)]
    avg = weighted_mean(locals_, [1.0] * 4)
    deltas = {k: before[k] - avg[k] for k in before}
    # lr 1 without momentum is plain model averaging.
    plain, _ = outer_nesterov_step(before, deltas, {}, lr=1.0, momentum=0.0)
    for k in before:
        torch.testing.assert_close(plain[k], avg[k])
    # Otherwise it is torch's SGD with Nesterov momentum on the pseudo-gradient.
    params = {k: torch.nn.Parameter(v.clone()) for k, v in before.items()}
    opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
    ours, state = dict(before), dict[str, torch.Tensor]()
    for _ in range(3):
        for k, p in params.items():
            p.grad = deltas[k].clone()
        opt.step()
        ours, state = outer_nesterov_step(ours, deltas, state, lr=0.7, momentum=0.9)
    for k in before:
        torch.testing.assert_close(ours[k], params[k].detach())
