"""Models written the usual way (tests/engine/corpus.py) and real ones from torchvision and timm
(tests/engine/zoo.py), exported, trained one step by the browser engine on every backend: forward output,
loss, every gradient and the updated buffers against PyTorch and float64, with test_parity's tolerance
(1e-4, or twice PyTorch float32's own error for an ill-conditioned model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.export import export_module
from tests.browser import graphs
from tests.browser.parity import float64_step
from tests.browser.test_parity import BACKENDS, compare, float32_spread, torch_reference, without_dropout
from tests.browser.test_parity import browser_run as run_in_browser
from tests.engine.corpus import CORPUS
from tests.engine.test_corpus import MODELS, batch

pytestmark = pytest.mark.browser
BATCH = 3
# The zoo models small enough for every backend in a few seconds each; the bigger ones run on WebGL and CPU
# as slow tests. tv_vit_b_16 (86M parameters, 343 MB of float32 weights) is not sent to the test browser.
ZOO_EVERY_BACKEND = ["tv_shufflenet_v2_x0_5", "tv_squeezenet1_1", "tv_mobilenet_v3_small", "tv_vit_tiny"]
# tv_regnet_x_400mf is not compared: at 32x32 and 64x64 batch norm over its last maps puts float32 PyTorch
# itself 200% / 36% off float64 in the gradients, so agreement with it means nothing (docs/corpus.md).
ZOO_SLOW = ["tv_resnet18", "tv_efficientnet_b0", "timm_convnext_atto", "timm_resnet10t"]
# TF.js 4.22's WebGL backend fails to compile a fragment shader for one of MobileViT's kernels (open: which
# one); the CPU backend trains it within tolerance.
MOBILEVIT_WEBGL = pytest.mark.xfail(strict=True, reason="TF.js WebGL: 'Failed to compile fragment shader'")
ZOO_SLOW_CASES = [(name, backend) for name in ZOO_SLOW for backend in ("webgl", "cpu")] + [
    ("timm_mobilevit_xxs", "cpu"),
    pytest.param("timm_mobilevit_xxs", "webgl", marks=MOBILEVIT_WEBGL),
]


def exported(name: str) -> tuple[graphs.Graph, graphs.Tensors]:
    spec = MODELS[name]
    torch.manual_seed(0)
    g, weights = export_module(spec.build(), spec.input_shape, spec.input_dtype, loss=spec.loss(), name=name)
    return without_dropout(g), weights


def batch_for(name: str, g: graphs.Graph) -> graphs.Tensors:
    x, y = batch(MODELS[name], BATCH, g["targets"][0]["shape"])
    return {"x": x, "y": y}


def check(harness: Any, backend: str, name: str) -> None:
    g, weights = exported(name)
    batch = batch_for(name, g)
    got = run_in_browser(harness, backend, g, weights, batch)
    want, (exact, exact_buffers) = torch_reference(g, weights, batch), float64_step(g, weights, batch)
    spread = float32_spread(g, weights, batch)
    compare(f"corpus:{name}", backend, got, want, exact, exact_buffers, spread=spread)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CORPUS) + ZOO_EVERY_BACKEND)
def test_corpus_model_trains_in_the_browser_as_in_pytorch(harness: Any, backend: str, name: str) -> None:
    check(harness, backend, name)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "backend"), ZOO_SLOW_CASES)
def test_bigger_zoo_model_trains_in_the_browser_as_in_pytorch(harness: Any, backend: str, name: str) -> None:
    check(harness, backend, name)
