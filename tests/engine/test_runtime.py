"""GraphModule and the gradient/evaluation helpers against plain torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.export import export_module
from engine.runtime import GraphModule, compute_gradients, evaluate, safe_attr
from tests.engine.conftest import exported, preset_batch, preset_module, reference_grads


def test_safe_attr_is_injective_and_dot_free() -> None:
    names = ["a.b", "a_b", "a_2eb", "a:b", "a/b", "a-b", "a__b", "ab"]
    mapped = [safe_attr(n) for n in names]
    assert len(set(mapped)) == len(names)
    assert all("." not in m and m.replace("_", "").isalnum() for m in mapped)


def test_params_and_buffers_are_registered_by_graph_name() -> None:
    graph, weights = exported("mlp")
    module = GraphModule(graph)
    assert len(list(module.parameters())) == 4
    module.load_state(weights)
    state = module.state()
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


def test_load_state_rejects_missing_and_misshapen_weights() -> None:
    graph, weights = exported("mlp")
    module = GraphModule(graph)
    with pytest.raises(KeyError, match="fc"):
        module.load_state({k: v for k, v in weights.items() if k != "fc1.bias"})
    bad = dict(weights, **{"fc2.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="fc2.weight"):
        module.load_state(bad)


def test_missing_input_is_reported() -> None:
    module = GraphModule(exported("mlp")[0])
    with pytest.raises(KeyError, match="'x'"):
        module({})
    with pytest.raises(ValueError, match=r"'x' has shape \[2, 1, 28, 27\], expected \[-1, 1, 28, 28\]"):
        module({"x": torch.zeros(2, 1, 28, 27)})


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_compute_gradients_matches_torch(name: str) -> None:
    graph, weights = exported(name)
    x, y = preset_batch(name, batch=3)
    ref = preset_module(name).train()
    _, ref_loss, ref_grads = reference_grads(ref, x, y)
    result = compute_gradients(graph, weights, {"x": x}, {"y": y.to(torch.int32)})
    assert result.loss == pytest.approx(float(ref_loss), abs=1e-5)
    assert result.grads.keys() == ref_grads.keys()
    for k, g in ref_grads.items():
        torch.testing.assert_close(result.grads[k], g, atol=1e-5, rtol=1e-4)


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4, momentum=0.3)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))
        return out


def test_batch_norm_buffers_update_like_torch_in_train_mode() -> None:
    torch.manual_seed(0)
    module = _BNNet()
    graph, weights = export_module(module, (2, 6, 6))
    x, y = torch.randn(5, 2, 6, 6), torch.randint(0, 3, (5,))
    result = compute_gradients(graph, weights, {"x": x}, {"y": y})
    module.train()
    F.cross_entropy(module(x), y).backward()
    torch.testing.assert_close(result.buffers["bn.running_mean"], module.bn.running_mean)
    torch.testing.assert_close(result.buffers["bn.running_var"], module.bn.running_var)
    torch.testing.assert_close(result.grads["conv.weight"], module.conv.weight.grad)
    assert not torch.equal(result.buffers["bn.running_var"], weights["bn.running_var"])


def test_evaluate_matches_manual_computation_in_chunks() -> None:
    graph, weights = exported("cnn")
    x, y = preset_batch("cnn", batch=10)
    ref = preset_module("cnn").eval()  # eval: dropout off
    with torch.no_grad():
        out = ref(x)
    result = evaluate(graph, weights, {"x": x}, {"y": y.to(torch.int32)}, batch_size=3)
    assert result["loss"] == pytest.approx(float(F.cross_entropy(out, y)), abs=1e-5)
    assert result["accuracy"] == pytest.approx(float((out.argmax(1) == y).float().mean()))


def test_evaluate_sequence_accuracy_counts_positions() -> None:
    graph, weights = exported("gpt")
    x, y = preset_batch("gpt", batch=3)
    ref = preset_module("gpt").eval()
    with torch.no_grad():
        out = ref(x)
    result = evaluate(graph, weights, {"x": x}, {"y": y}, batch_size=2)
    assert result["loss"] == pytest.approx(
        float(F.cross_entropy(out.reshape(-1, 65), y.reshape(-1))), abs=1e-5
    )
    assert result["accuracy"] == pytest.approx(float((out.argmax(-1) == y).float().mean()))


def test_mse_graph_has_no_accuracy() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
    graph, weights = export_module(module, (3,), loss="mse")
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    result = evaluate(graph, weights, {"x": x}, {"y": y})
    with torch.no_grad():
        assert result == {"loss": pytest.approx(float(F.mse_loss(module(x), y)), abs=1e-6)}


def test_dropout_is_identity_in_eval_and_random_in_train() -> None:
    graph, weights = exported("cnn")
    module = GraphModule(graph)
    module.load_state(weights)
    x, _ = preset_batch("cnn", batch=2)
    module.eval()
    assert torch.equal(module({"x": x}), module({"x": x}))
    module.train()
    assert not torch.equal(module({"x": x}), module({"x": x}))


def test_local_steps_equal_a_torch_sgd_loop() -> None:
    import copy

    from engine.presets import build_preset, export_preset
    from engine.runtime import local_steps

    torch.manual_seed(0)
    graph, weights = export_preset("mlp")
    x, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    result = local_steps(graph, weights, {"x": x}, {"y": y}, batch_size=4, lr=0.1, momentum=0.9)

    module = copy.deepcopy(build_preset("mlp"))
    module.load_state_dict(weights)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for start in range(0, 10, 4):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(module(x[start : start + 4]), y[start : start + 4]).backward()
        optimizer.step()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(result.delta[name], weights[name] - value, rtol=1e-5, atol=1e-6)
    assert result.loss > 0
