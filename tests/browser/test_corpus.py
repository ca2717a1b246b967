"""Models written the usual way (tests/engine/corpus.py), exported, trained one step by the browser engine
on every backend: forward output, loss, every gradient and the updated buffers against PyTorch and float64,
with test_parity's tolerance (1e-4, or twice PyTorch float32's own error for an ill-conditioned model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.export import export_module
from tests.browser import graphs
from tests.browser.test_parity import BACKENDS, compare, float64_gradients, torch_reference, without_dropout
from tests.browser.test_parity import browser_run as run_in_browser
from tests.engine.corpus import CORPUS
from tests.engine.test_corpus import batch

pytestmark = pytest.mark.browser
BATCH = 3


def exported(name: str) -> tuple[graphs.Graph, graphs.Tensors]:
    spec = CORPUS[name]
    torch.manual_seed(0)
    g, weights = export_module(spec.build(), spec.input_shape, spec.input_dtype, loss=spec.loss(), name=name)
    return without_dropout(g), weights


def batch_for(name: str, g: graphs.Graph) -> graphs.Tensors:
    x, y = batch(CORPUS[name], BATCH, g["targets"][0]["shape"])
    return {"x": x, "y": y}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_model_trains_in_the_browser_as_in_pytorch(harness: Any, backend: str, name: str) -> None:
    g, weights = exported(name)
    batch = batch_for(name, g)
    got = run_in_browser(harness, backend, g, weights, batch)
    want, exact = torch_reference(g, weights, batch), float64_gradients(g, weights, batch)
    compare(f"corpus:{name}", backend, got, want, exact)
