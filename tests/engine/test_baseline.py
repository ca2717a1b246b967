"""One machine's equivalent of the server's step (engine/baseline.py), checked against plain torch.optim."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import baseline
from engine.graph import load_graph
from tests.engine.conftest import exported, preset_batch, preset_module


def recipe(**overrides: object) -> baseline.Recipe:
    values: dict[str, object] = {
        "mode": "sync_sgd",
        "round_samples": 8,
        "batch_size": 4,
        "learning_rate": 0.1,
        "momentum": 0.9,
        "weight_decay": 0.01,
        "local_learning_rate": 0.05,
        "local_momentum": 0.0,
        "local_batch_size": 2,
    }
    return baseline.Recipe(**{**values, **overrides})  # type: ignore[arg-type]


def test_a_sync_step_is_one_torch_sgd_step_on_the_whole_round() -> None:
    graph_dict, weights = exported("mlp")
    graph, module = load_graph(graph_dict), preset_module("mlp")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    state: dict[str, torch.Tensor] = {}
    for seed in (1, 2):  # two steps: the momentum buffer carries over
        x, y = preset_batch("mlp", batch=8, seed=seed)
        optimizer.zero_grad()
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
        result = baseline.step(graph, weights, state, x, y, recipe())
        weights, state = result.weights, result.state
    for name, value in module.state_dict().items():
        torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=1e-5)


def test_an_averaging_step_with_a_plain_outer_step_is_local_sgd_over_the_round() -> None:
    graph_dict, weights = exported("mlp")
    graph, module = load_graph(graph_dict), preset_module("mlp")
    x, y = preset_batch("mlp", batch=8, seed=3)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    for start in range(0, 8, 2):  # local mini-batches of local_batch_size
        optimizer.zero_grad()
        F.cross_entropy(module(x[start : start + 2]), y[start : start + 2]).backward()
        optimizer.step()
    # outer lr 1 and no momentum: the outer step applies the single worker's delta as it is
    result = baseline.step(
        graph, weights, {}, x, y, recipe(mode="averaging", learning_rate=1.0, momentum=0.0)
    )
    for name, value in module.state_dict().items():
        torch.testing.assert_close(result.weights[name], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("mode", "samples"), [("sync_sgd", 8), ("averaging", 8), ("async_sgd", 4)])
def test_a_step_takes_a_round_and_async_takes_one_work_unit(mode: str, samples: int) -> None:
    assert recipe(mode=mode).step_samples == samples


def test_the_cursor_walks_the_split_in_order_and_wraps_into_the_next_epoch() -> None:
    cursor = baseline.Cursor(np.arange(5, dtype=np.float32)[:, None], np.arange(5))
    assert cursor.take(3)[1].tolist() == [0, 1, 2]
    assert cursor.take(4)[1].tolist() == [3, 4, 0, 1]
    assert cursor.take(1)[1].tolist() == [2]


def test_evaluate_names_metrics_as_the_platform_stores_them() -> None:
    graph_dict, weights = exported("mlp")
    x, y = preset_batch("mlp", batch=16, seed=4)
    metrics = baseline.evaluate(load_graph(graph_dict), weights, x, y)
    assert set(metrics) == {"test_loss", "test_accuracy"}
    with torch.no_grad():
        expected = float(F.cross_entropy(preset_module("mlp")(x), y))
    assert metrics["test_loss"] == pytest.approx(expected, rel=1e-5)
