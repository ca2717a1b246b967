"""The losses: exactly torch's F.cross_entropy (class weights, ignore_index, label smoothing) and
F.l1_loss, forward and gradient, through run_loss, the graph's loss spec and runtime.evaluate."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.ops import loss_attrs, loss_denominator, run_loss
from engine.runtime import GraphModule, compute_gradients, evaluate

GEN = torch.Generator().manual_seed(0)
CLASS_WEIGHTS = torch.rand(5, generator=GEN) + 0.5


def _targets(shape: tuple[int, ...], ignore: int) -> Tensor:
    """Class ids with about a third of them replaced by `ignore`."""
    target = torch.randint(0, 5, shape, generator=GEN)
    return torch.where(torch.rand(shape, generator=GEN) < 0.35, torch.full(shape, ignore), target)


CASES = [
    ({}, False),
    ({"label_smoothing": 0.2}, False),
    ({}, True),
    ({"ignore_index": 2}, False),  # an ignore_index that is also a class id
    ({"ignore_index": -100, "label_smoothing": 0.1}, True),
    ({"ignore_index": 3, "label_smoothing": 1.0}, True),
]


@pytest.mark.parametrize(("attrs", "weighted"), CASES, ids=[f"{a}-weighted={w}" for a, w in CASES])
@pytest.mark.parametrize("shape", [(7,), (3, 4)], ids=["rows", "sequence"])
def test_cross_entropy_is_torchs_forward_and_gradient(
    attrs: dict[str, Any], weighted: bool, shape: tuple[int, ...]
) -> None:
    at = loss_attrs("cross_entropy", attrs)
    target = _targets(shape, at["ignore_index"])
    logits = torch.randn((*shape, 5), generator=GEN, requires_grad=True)
    weight = CLASS_WEIGHTS if weighted else None
    got = run_loss("cross_entropy", logits, target, attrs, weight)
    # torch's own layout for sequences is [N, C, T]: an independent route to the same mean.
    native = logits if len(shape) == 1 else logits.permute(0, 2, 1)
    want = F.cross_entropy(
        native, target, weight, ignore_index=at["ignore_index"], label_smoothing=at["label_smoothing"]
    )
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(*(torch.autograd.grad(loss, logits)[0] for loss in (got, want)))


def test_weighted_mean_divides_by_the_kept_targets_weights() -> None:
    logits, target = torch.randn(4, 5, generator=GEN), torch.tensor([1, -100, 3, 1])
    picked = -torch.log_softmax(logits, 1)[[0, 2, 3], [1, 3, 1]]
    w = CLASS_WEIGHTS[[1, 3, 1]]
    torch.testing.assert_close(
        run_loss("cross_entropy", logits, target, {}, CLASS_WEIGHTS), (picked * w).sum() / w.sum()
    )
    assert loss_denominator("cross_entropy", target, {}, CLASS_WEIGHTS) == pytest.approx(float(w.sum()))
    assert loss_denominator("cross_entropy", torch.tensor([1, 0, 3, 1]), {"ignore_index": 1}) == 2.0


def test_loss_attrs_default_from_the_spec_file() -> None:
    assert loss_attrs("cross_entropy") == {"label_smoothing": 0.0, "ignore_index": -100}
    assert loss_attrs("cross_entropy", {"ignore_index": 0}) == {"label_smoothing": 0.0, "ignore_index": 0}
    assert loss_attrs("l1") == {} == loss_attrs("mse")


def test_l1_is_torchs_with_a_zero_gradient_where_prediction_equals_target() -> None:
    pred = torch.randn(4, 3, generator=GEN)
    target = pred.clone()
    target[0] += 1.0
    target[1] -= 2.0
    pred.requires_grad_()
    got = run_loss("l1", pred, target)
    torch.testing.assert_close(got, F.l1_loss(pred, target))
    (grad,) = torch.autograd.grad(got, pred)
    want = torch.zeros(4, 3)
    want[0], want[1] = -1 / 12, 1 / 12
    torch.testing.assert_close(grad, want)


GRAPH: dict[str, Any] = {
    "format": "crowdtrain.graph",
    "version": 1,
    "inputs": [{"name": "x", "shape": [-1, 6], "dtype": "float32"}],
    "targets": [{"name": "y", "shape": [-1], "dtype": "int64"}],
    "params": [{"name": "fc.weight", "shape": [5, 6]}, {"name": "fc.bias", "shape": [5]}],
    "buffers": [{"name": "class_weight", "shape": [5]}],
    "nodes": [{"name": "fc", "op": "linear", "inputs": ["x", "fc.weight", "fc.bias"]}],
    "output": "fc",
    "loss": {
        "op": "cross_entropy",
        "inputs": ["fc", "y", "class_weight"],
        "attrs": {"label_smoothing": 0.1, "ignore_index": 4},
    },
}


def _weights() -> dict[str, Tensor]:
    return {
        "fc.weight": torch.randn(5, 6, generator=GEN),
        "fc.bias": torch.randn(5, generator=GEN),
        "class_weight": CLASS_WEIGHTS,
    }


def test_the_runtime_uses_the_graphs_loss_attrs_and_class_weights() -> None:
    weights = _weights()
    x, y = torch.randn(9, 6, generator=GEN), _targets((9,), ignore=4)
    result = compute_gradients(GRAPH, weights, {"x": x}, {"y": y})
    w, b = (weights[n].clone().requires_grad_() for n in ("fc.weight", "fc.bias"))
    loss = F.cross_entropy(F.linear(x, w, b), y, CLASS_WEIGHTS, ignore_index=4, label_smoothing=0.1)
    loss.backward()
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-6)
    torch.testing.assert_close(result.grads["fc.weight"], w.grad)
    torch.testing.assert_close(result.grads["fc.bias"], b.grad)


@pytest.mark.parametrize("loss", [GRAPH["loss"], {"op": "cross_entropy", "inputs": ["fc", "y"]}])
def test_evaluate_in_chunks_is_the_mean_over_the_whole_set(loss: dict[str, Any]) -> None:
    graph = {**copy.deepcopy(GRAPH), "loss": loss}
    weights = _weights()
    x, y = torch.randn(10, 6, generator=GEN), _targets((10,), ignore=4)
    y[:3] = 4  # the first chunk of 3 is all ignored where the loss ignores 4: torch's mean there is 0/0
    module = GraphModule(graph)
    module.load_state(weights)
    with torch.no_grad():
        out = module({"x": x})
        whole = float(module.loss(out, {"y": y}))
    result = evaluate(graph, weights, {"x": x}, {"y": y}, batch_size=3)
    assert result["loss"] == pytest.approx(whole, rel=1e-5)
    scored = y != module.graph.loss.attrs["ignore_index"]
    assert result["accuracy"] == pytest.approx(float((out.argmax(1) == y)[scored].float().mean()))


NOTHING_SCORED = [
    ({}, False, "ignored"),
    ({"label_smoothing": 0.3}, True, "ignored"),
    ({"ignore_index": 2, "label_smoothing": 0.1}, False, "ignored"),
    ({}, True, "weighted 0"),
    ({"label_smoothing": 0.3}, True, "weighted 0"),
]


@pytest.mark.parametrize(("attrs", "weighted", "how"), NOTHING_SCORED, ids=[str(c) for c in NOTHING_SCORED])
@pytest.mark.parametrize("shape", [(4,), (2, 3)], ids=["rows", "sequence"])
def test_a_batch_with_nothing_scored_has_loss_0_and_zero_gradients_where_torch_has_nan(
    attrs: dict[str, Any], weighted: bool, how: str, shape: tuple[int, ...]
) -> None:
    """A deviation from torch, on purpose: its mean is 0/0 there, and an honest volunteer's NaN would be
    judged invalid. Targets all ignore_index, or all of classes whose weight is 0."""
    at = loss_attrs("cross_entropy", attrs)
    weight = CLASS_WEIGHTS.clone() if weighted else None
    target = torch.full(shape, at["ignore_index"])
    if how == "weighted 0":
        assert weight is not None
        weight[1], target = 0.0, torch.ones(shape, dtype=torch.int64)
    logits = torch.randn((*shape, 5), generator=GEN, requires_grad=True)
    flat = logits.reshape(-1, 5), target.reshape(-1)
    torchs = F.cross_entropy(
        *flat, weight, ignore_index=at["ignore_index"], label_smoothing=at["label_smoothing"]
    )
    assert torch.isnan(torchs) or torch.isinf(torchs)

    got = run_loss("cross_entropy", logits, target, attrs, weight)
    assert float(got.detach()) == 0.0
    assert torch.equal(torch.autograd.grad(got, logits)[0], torch.zeros_like(logits))


def test_an_all_ignored_batch_gives_the_runtime_zero_gradients() -> None:
    x, y = torch.randn(3, 6, generator=GEN), torch.full((3,), 4)  # GRAPH's loss ignores 4
    result = compute_gradients(GRAPH, _weights(), {"x": x}, {"y": y})
    assert result.loss == 0.0
    assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in result.grads.values())
    assert set(result.grads) == {"fc.weight", "fc.bias"}
