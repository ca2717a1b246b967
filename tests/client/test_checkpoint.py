"""crowdtrain.checkpoint: the exporter's names are the module's state_dict names, and loading is strict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from crowdtrain.checkpoint import decode, load_into, load_tensors
from crowdtrain.errors import CheckpointMismatch, CrowdtrainError
from crowdtrain.exporting import export
from engine import codecs
from tests.client.models import DigitNet


def trained_weights() -> dict[str, torch.Tensor]:
    """DigitNet's exported weights after a few train-mode batches (running statistics moved)."""
    torch.manual_seed(0)
    model = DigitNet()
    for _ in range(3):
        model(torch.randn(16, 1, 28, 28))
    return export(model, (1, 28, 28), name="DigitNet").weights


def test_every_float_tensor_of_the_module_is_in_the_checkpoint_under_its_state_dict_name() -> None:
    weights = trained_weights()
    floats = {name for name, t in DigitNet().state_dict().items() if t.is_floating_point()}
    assert set(weights) == floats
    assert "features.1.running_mean" in weights and "features.1.running_var" in weights


def test_loaded_module_computes_what_the_exported_one_did(tmp_path: Path) -> None:
    weights = trained_weights()
    path = tmp_path / "weights.safetensors"
    path.write_bytes(codecs.encode(weights))
    model = DigitNet().eval()
    loaded = load_into(model, file=path)
    assert loaded.version is None and "features.5.running_var" in loaded.names
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name
    assert int(model.state_dict()["features.1.num_batches_tracked"]) == 0  # left as it was


def test_a_name_the_module_lacks_is_named() -> None:
    weights = {**trained_weights(), "classifier.weight": torch.zeros(3)}
    with pytest.raises(CheckpointMismatch, match="the module has no classifier.weight"):
        load_tensors(DigitNet(), weights)


def test_a_shape_that_differs_is_named_and_nothing_is_loaded() -> None:
    model = DigitNet(width=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatch, match=r"features\.0\.weight \[8, 1, 3, 3\] vs \[4, 1, 3, 3\]"):
        load_tensors(model, trained_weights())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_missing_float_tensor_is_an_error_unless_not_strict() -> None:
    weights = trained_weights()
    del weights["features.5.running_var"]
    with pytest.raises(CheckpointMismatch, match=r"has no features\.5\.running_var \(strict=False"):
        load_tensors(DigitNet(), weights)
    assert "features.5.running_var" not in load_tensors(DigitNet(), weights, strict=False)


def test_tied_weights_load_through_either_name() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(x)).mean(1)

    source, target = Tied(), Tied()
    graph_weights = export(source, (5,), input_dtype="int64", name="Tied").weights
    assert len(graph_weights) == 1
    load_tensors(target, graph_weights)
    assert torch.equal(target.out.weight, source.out.weight)


def test_the_losss_class_weights_belong_to_no_module_and_are_skipped() -> None:
    loss = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, 10))
    weights = export(DigitNet(), (1, 28, 28), loss=loss, name="DigitNet").weights
    assert "loss:weight" in weights
    assert "loss:weight" not in load_tensors(DigitNet(), weights)


def test_values_keep_the_modules_dtype() -> None:
    model = DigitNet().double()
    load_tensors(model, trained_weights())
    assert model.head.weight.dtype == torch.float64


def test_garbage_is_not_a_checkpoint() -> None:
    with pytest.raises(CrowdtrainError, match="not a valid checkpoint"):
        decode(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage", "weights.safetensors")


def test_load_into_needs_exactly_one_source(tmp_path: Path) -> None:
    with pytest.raises(CrowdtrainError, match="either project"):
        load_into(DigitNet())
    with pytest.raises(CrowdtrainError, match="either project"):
        load_into(DigitNet(), project=1, file=tmp_path / "w.safetensors")
