"""One machine's equivalent of a project's server step, for the time-to-accuracy baseline.

The server steps a project with the same functions (runtime.compute_gradients / local_steps, then
optim.sgd_step / outer_nesterov_step); here one process computes every update itself, in order:

- sync_sgd: one step per `round_samples` samples. The round is cut into work units of at most `batch_size`
  samples, as volunteers get them, and their gradients are averaged weighted by samples (the aggregator's
  mean), so batch statistics are per work unit as on the platform; then one SGD-momentum step.
- async_sgd: with one worker there is no staleness, so every work unit (`batch_size` samples) is a step.
- averaging: DiLoCo with a single worker. It runs the local SGD (`local_batch_size`, local rate and
  momentum) over the whole round's `round_samples` samples and the outer Nesterov step applies its delta.
  Averaging exists to combine many workers; one machine has only itself to average, so it walks the same
  samples per outer step with no averaging (its per-sample progress is at least the platform's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine import aggregate, optim, runtime
from engine.graph import Graph

Tensors = dict[str, Tensor]


@dataclass(frozen=True)
class Recipe:
    """The project's optimizer settings, as the server's step reads them."""

    mode: str
    round_samples: int
    batch_size: int
    learning_rate: float
    momentum: float
    weight_decay: float
    local_learning_rate: float
    local_momentum: float
    local_batch_size: int

    @property
    def step_samples(self) -> int:
        return self.batch_size if self.mode == "async_sgd" else self.round_samples


@dataclass(frozen=True)
class StepResult:
    weights: Tensors
    state: Tensors
    loss: float


class Cursor:
    """Walks the training split in order, epoch after epoch, as the platform's data cursor does."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y, self.position = x, y, 0

    def take(self, count: int) -> tuple[Tensor, Tensor]:
        n = len(self.x)
        index = (self.position + np.arange(count)) % n
        self.position = int((self.position + count) % n)
        return torch.from_numpy(self.x[index]), torch.from_numpy(self.y[index])


def step(graph: Graph, weights: Tensors, state: Tensors, x: Tensor, y: Tensor, recipe: Recipe) -> StepResult:
    """One server step's worth of training on the batch (x, y) of `recipe.step_samples` samples."""
    if recipe.mode == "averaging":
        return _averaging_step(graph, weights, state, x, y, recipe)
    return _sgd_step(graph, weights, state, x, y, recipe)


def _sgd_step(
    graph: Graph, weights: Tensors, state: Tensors, x: Tensor, y: Tensor, recipe: Recipe
) -> StepResult:
    sizes, grads, buffers, losses = [], [], [], []
    for start in range(0, len(x), recipe.batch_size):
        inputs, targets = _named(
            graph, x[start : start + recipe.batch_size], y[start : start + recipe.batch_size]
        )
        result = runtime.compute_gradients(graph, weights, inputs, targets)
        sizes.append(float(len(inputs[graph.inputs[0].name])))
        grads.append(result.grads)
        buffers.append(result.buffers)
        losses.append(result.loss)
    grad = aggregate.weighted_mean(grads, sizes)
    params, new_state = _server_step(weights, grad, state, recipe)
    trained = _trained(graph, buffers)
    return StepResult({**params, **_mean_buffers(trained, sizes)}, new_state, _mean(losses, sizes))


def _averaging_step(
    graph: Graph, weights: Tensors, state: Tensors, x: Tensor, y: Tensor, recipe: Recipe
) -> StepResult:
    inputs, targets = _named(graph, x, y)
    local = runtime.local_steps(
        graph,
        weights,
        inputs,
        targets,
        batch_size=recipe.local_batch_size,
        lr=recipe.local_learning_rate,
        momentum=recipe.local_momentum,
    )
    params, new_state = _server_step(weights, local.delta, state, recipe)
    return StepResult({**params, **_trained(graph, [local.buffers])[0]}, new_state, local.loss)


def _server_step(
    weights: Tensors, update: Tensors, state: Tensors, recipe: Recipe
) -> tuple[Tensors, Tensors]:
    return optim.server_step(
        weights,
        update,
        state,
        averaging=recipe.mode == "averaging",
        lr=recipe.learning_rate,
        momentum=recipe.momentum,
        weight_decay=recipe.weight_decay,
    )


def _named(graph: Graph, x: Tensor, y: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    return {graph.inputs[0].name: x}, {graph.targets[0].name: y}


def _trained(graph: Graph, buffers: list[Tensors]) -> list[Tensors]:
    """Only buffers an op updates while training move (batch norm's running stats), as on the server."""
    names = graph.trained_buffers()
    return [{name: b[name] for name in names} for b in buffers]


def _mean_buffers(buffers: list[Tensors], sizes: list[float]) -> Tensors:
    return aggregate.weighted_mean(buffers, sizes) if buffers and buffers[0] else {}


def _mean(values: list[float], sizes: list[float]) -> float:
    return sum(v * s for v, s in zip(values, sizes, strict=True)) / max(sum(sizes), 1.0)


def evaluate(graph: Graph, weights: Mapping[str, Tensor], x: Tensor, y: Tensor) -> dict[str, float]:
    """Test metrics under the names the platform stores them with (test_loss, test_accuracy)."""
    inputs, targets = _named(graph, x, y)
    return {
        f"test_{name}": value for name, value in runtime.evaluate(graph, weights, inputs, targets).items()
    }
