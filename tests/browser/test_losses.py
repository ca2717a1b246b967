"""Cross-entropy where nothing is scored (every target ignore_index, or of a class weighted 0): the browser
engine gives loss 0 and zero gradients, as engine.ops.run_loss does, where torch's own mean is 0/0 (NaN). An
honest volunteer's batch of padding must not be judged invalid."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.browser import graphs
from tests.browser.test_parity import BACKENDS, browser_run, torch_reference

pytestmark = pytest.mark.browser
Case = tuple[graphs.Graph, graphs.Tensors, graphs.Tensors]


def ignored_rows() -> Case:
    """resample: class weights, label smoothing 0.15 and ignore_index 2 (a class id); every target is 2."""
    g = graphs.resample()
    batch = graphs.batch_for(g, 4, seed=7)
    batch["y"] = torch.full_like(batch["y"], 2)
    return g, graphs.init_weights(g, seed=3), batch


def ignored_sequence() -> Case:
    """seq: one next-token target per position, torch's default ignore_index -100 everywhere."""
    g = graphs.seq()
    batch = graphs.batch_for(g, 3, seed=7)
    batch["y"] = torch.full_like(batch["y"], -100)
    return g, graphs.init_weights(g, seed=3), batch


def weighted_zero() -> Case:
    """resample again, every target of class 1, whose class weight is 0: scored, but weighing nothing."""
    g, weights, batch = ignored_rows()
    weights["class_weight"] = weights["class_weight"].clone()
    weights["class_weight"][1] = 0.0
    batch["y"] = torch.ones_like(batch["y"])
    return g, weights, batch


CASES: dict[str, Callable[[], Case]] = {
    "ignored-rows": ignored_rows,
    "ignored-sequence": ignored_sequence,
    "weighted-zero": weighted_zero,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_nothing_scored_is_loss_0_with_zero_gradients_on_both_engines(
    harness: Any, backend: str, case: str
) -> None:
    g, weights, batch = CASES[case]()
    got = browser_run(harness, backend, g, weights, batch)
    want = torch_reference(g, weights, batch)
    assert got["loss"] == want["loss"] == 0.0
    assert set(got["grads"]) == set(want["grads"]) == {p["name"] for p in g["params"]}
    for name, grad in got["grads"].items():
        assert torch.equal(grad, torch.zeros_like(grad)), f"{name} on {backend}: {grad.abs().max()}"
        assert torch.equal(want["grads"][name], torch.zeros_like(grad)), name
